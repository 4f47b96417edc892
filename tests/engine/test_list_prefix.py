"""ListPrefix (gpu_engine/list_prefix.py) reads as the list prefix it stands for, and the engine's unfinished
outputs use it without changing what a caller sees."""
from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest

from gpu_engine.list_prefix import ListPrefix


def test_reads_as_the_prefix_while_the_list_grows() -> None:
    items = [10, 11, 12]
    view = ListPrefix(items, 2)
    items += [13, 14]
    assert len(view) == 2 and list(view) == [10, 11] and view == [10, 11] and [10, 11] == view
    assert view != [10, 11, 12] and view != (10, 11) and view == ListPrefix([10, 11, 99], 2)
    assert view[0] == 10 and view[-1] == 11 and view[-2] == 10
    with pytest.raises(IndexError):
        view[2]
    with pytest.raises(IndexError):
        view[-3]
    assert view[1:] == [11] and view[5:] == [] and view[::-1] == [11, 10] and view[:] == [10, 11]
    assert view + [1] == [10, 11, 1] and [1] + view == [1, 10, 11]
    assert 11 in view and 12 not in view and view.index(11) == 1 and repr(view) == "[10, 11]"
    for clone in (copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert type(clone) is list and clone == [10, 11]
    with pytest.raises(TypeError):
        hash(view)


def test_not_a_list_where_the_docstring_says_so() -> None:
    from gpu_engine.params import RequestOutput, TokenLogprob

    view = ListPrefix([1, 2, 3], 2)
    assert not isinstance(view, list) and json.dumps(view.tolist()) == "[1, 2]"
    with pytest.raises(TypeError):
        json.dumps(view)
    lp = TokenLogprob(1, "a", -0.5)
    out = RequestOutput("r", "a", view, False, logprobs=ListPrefix([lp], 1))
    assert dataclasses.asdict(out)["logprobs"] == [lp]  # the items themselves, not {"token_id": ...} dicts


def test_unfinished_outputs_keep_what_they_showed(tmp_path) -> None:
    """Each streamed output shows the tokens and logprobs generated up to it, however far the request runs on;
    the final output owns plain lists."""
    from gpu_engine.engine import Engine
    from gpu_engine.engine_config import EngineConfig
    from gpu_engine.params import SamplingParams
    from gpu_engine.tiny import make_tiny_checkpoint

    eng = Engine.from_pretrained(make_tiny_checkpoint(tmp_path, seed=3), config=EngineConfig(max_num_seqs=4))
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2)
    rid = eng.add_request([5, 6, 7, 8], params)
    seen = []
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            seen.append((out, out.token_ids[:], [lp.token_id for lp in out.logprobs], len(out.text)))
    final = seen[-1][0]
    assert final.finished and type(final.token_ids) is list and type(final.logprobs) is list
    assert len(final.token_ids) == 12 and [lp.token_id for lp in final.logprobs] == final.token_ids
    for out, ids, lp_ids, chars in seen[:-1]:
        assert not out.finished and isinstance(out.token_ids, ListPrefix)
        assert out.token_ids == ids == final.token_ids[: len(ids)] and lp_ids == ids and len(out.text) == chars
    assert [len(ids) for _, ids, _, _ in seen] == list(range(1, 13))
