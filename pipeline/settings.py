"""All configuration of docpipe in one place: pipeline, workers and API read the same `Settings`.

Values come from (highest first) constructor arguments, environment variables prefixed `DOCPIPE_`, a `.env`
file in the working directory, then the defaults below. List values (API keys, watch folders) accept either a JSON
list or a comma-separated string: `DOCPIPE_API_KEYS=key1,key2`.

The data directory defaults to `./.docpipe` (next to where docpipe runs, like a git checkout's `.git`), so a demo
or a test never writes into the user's home and two projects never share a database by accident. Set
`DOCPIPE_DATA_DIR` (for example to `~/.local/share/docpipe`) for a per-user installation.

BLAS threads are not a `Settings` field: the BLAS library reads its thread count from the environment once, when
numpy loads, before any settings exist. Every docpipe entry point (`docpipe ...`, `api.app`, the Celery app) sets
`OMP_NUM_THREADS`, `OPENBLAS_NUM_THREADS`, `MKL_NUM_THREADS`, ... to half the usable CPUs (at least 1, at most 4)
unless you set them yourself: `OMP_NUM_THREADS=8 docpipe process ...` wins. Without a cap, BLAS threads fought the
engine's and the jobs' own threads; on a busy 2-core machine the in-process path ran about 7x slower
(see pipeline.threads).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

Runner = Literal["reference", "cuda"]
Quantize = Literal["none", "fp8"]
BUNDLED_MAX_STRING_LENGTH = 24
BUNDLED_MAX_ARRAY_ITEMS = 3
# The engine's batch sizes when the settings leave them 0: the reference runner keeps these small ones; on the cuda
# runner the engine sizes them from the device and model (gpu_engine/batch_defaults.py: up to 256 sequences, 8192
# tokens a step), so before it is built a job-slot count can only assume that cap.
REFERENCE_MAX_NUM_SEQS = 16
REFERENCE_MAX_BATCHED_TOKENS = 2048
REFERENCE_EMBEDDED_JOBS = 4
# Page requests a process keeps at the engine by default, in engine batches: one batch running, the next one's
# pages decoded and preprocessed, waiting (a processed A4 page at 150 dpi holds 53 MB of float32 pixels until its
# vision encode).
PAGES_IN_FLIGHT_PER_BATCH = 2
# Page preparation processes by default on cuda: one prepares ~7-10 pages/s, 4 outpace the 0.8B engine's ~20.
PREP_PROCESSES_MAX = 4
WatchAction = Literal["leave", "move"]


def _split_list(value: Any) -> Any:
    """Accept `a,b,c` as well as a JSON list from the environment."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DOCPIPE_", env_file=".env", env_file_encoding="utf-8", extra="ignore", frozen=True,
        hide_input_in_errors=True,  # a refused value may be a secret (API keys, a database URL with a password)
    )

    # --- where things live -------------------------------------------------------------------------------------
    data_dir: Path = Field(Path(".docpipe"), description="Blobs and the default SQLite database live here.")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; None = SQLite file <data_dir>/docpipe.sqlite. PostgreSQL: "
        "postgresql+psycopg://user@host/db"
    )
    # --- model and engine ----------------------------------------------------------------------------------------
    model_dir: Path | None = Field(None, description="HF-format Qwen3.5 checkpoint folder; None = bundled tiny model.")
    model_id: str | None = Field(
        None, description="Name of the model for job dedupe on hosts without the weights (e.g. an API in broker "
        "mode); None = derived from model_dir. Set it on every host or on none."
    )
    runner: Runner = Field("reference", description="Engine runner: reference (numpy, CPU) or cuda.")
    engine_max_num_seqs: int = Field(
        0, ge=0, description="Sequences the engine batches together; 0 = the runner's default (16 on reference, "
        "sized from the GPU memory left for the cache on cuda: 256 for the 0.8B-9B models on an H200)."
    )
    engine_max_batched_tokens: int = Field(
        0, ge=0, description="Token budget of one engine step (prefill chunk); 0 = the runner's default (2048 on "
        "reference, 8192 on cuda)."
    )
    engine_max_model_len: int = Field(16384, ge=256, description="Longest prompt + output the engine accepts.")
    engine_lookahead: bool = Field(
        True, description="Launch the next decode step before taking in the tokens of the one on the GPU (cuda "
        "runner; gpu_engine/lookahead.py), so the host's per-token work overlaps the forward; false = every step's "
        "tokens first."
    )
    engine_kv_cache_bytes: int | None = Field(
        None, ge=1, description="Memory budget for the KV cache; None = the engine's own default."
    )
    engine_pages_in_flight: int = Field(
        0, ge=0, description="Page requests one process (a GPU worker, `docpipe process`) keeps at the engine at "
        "once, over all its jobs; each holds its page image and, until its vision encode, its processed pixels (~53 MB "
        "at 150 dpi). 0 = 2 x the engine's max_num_seqs (512 on an H200 with the engine sizing its batch, 32 on "
        "reference)."
    )
    engine_prep_processes: int | None = Field(
        None, ge=0, description="Child processes that prepare page requests (PNG decode, resize, patches, tokens) "
        "outside the engine's process, handing the pixels back through /dev/shm, so the jobs' CPU work leaves the "
        "engine's step thread the GIL (pipeline.page_prep). 0 = on the job threads; None = min(4, CPUs / 4) on "
        "cuda, 0 on reference."
    )
    engine_quantize: Quantize = Field(
        "none", description="Weights: none (as the checkpoint stores them; an FP8 checkpoint runs in FP8) or fp8 (a "
        "BF16 checkpoint's Linears become 128x128-block FP8 at load; results record the at-load fingerprint)."
    )
    # --- extraction ----------------------------------------------------------------------------------------------
    default_schema: str = Field("generic", description="Extraction schema used when none is given.")
    max_tokens: int = Field(2048, ge=1, description="Output token cap of one extraction request.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0 = greedy, reproducible).")
    request_timeout_s: float = Field(600.0, gt=0, description="Wall-clock cap per engine request (engine-enforced).")
    grammar_max_string_length: int | None = Field(
        None, ge=1, description="Tighten every free-text string's maxLength in the decoding grammar (bounds output); "
        "None = the schema's own, or 24 with the bundled tiny model."
    )
    grammar_max_array_items: int | None = Field(
        None, ge=0, description="Tighten every array's maxItems in the decoding grammar (bounds output); "
        "None = the schema's own, or 3 with the bundled tiny model."
    )
    image_cache_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="Rendered pages kept in memory between intake and extraction (0 = off)."
    )
    anchor_text_chars: int = Field(4000, ge=0, description="PDF text-layer characters offered to the prompt per page.")
    # --- media limits and rendering (passed to vision) -----------------------------------------------------------
    max_file_bytes: int = Field(512 * 1024 * 1024, ge=1, description="Largest accepted input file.")
    max_pages: int = Field(2000, ge=1, description="Most pages (PDF/TIFF) per document.")
    max_page_pixels: int = Field(16_000_000, ge=1, description="Rendered pages/frames are downscaled to this.")
    max_photo_pixels: int = Field(
        3_145_728, ge=1, description="Raster images (photos, scans) are downscaled to this (2048 x 1536: an A4 sheet "
        "filling 86% of the long side stays at 150 dpi); PDF pages and video frames are not (vision.MediaLimits)."
    )
    max_video_seconds: float = Field(600.0, gt=0, description="Longest accepted video.")
    pdf_dpi: float = Field(150.0, gt=0, description="PDF render resolution.")
    video_fps: float = Field(2.0, gt=0, description="Video frames sampled per second (Qwen's rule).")
    video_max_frames: int = Field(64, ge=4, description="Most frames sampled from one video.")
    page_render_timeout_s: float = Field(
        20.0, gt=0, description="Render budget of one PDF page or image (decode); over it the page fails.")
    document_render_timeout_s: float = Field(
        900.0, gt=0, description="Render budget of one document; once spent, its unrendered pages fail.")
    max_page_draw_ops: int = Field(
        5_000_000, ge=1, description="Drawing operations one PDF page may expand to (nested forms counted).")
    max_document_draw_ops: int = Field(
        200_000_000, ge=1, description="Drawing operations all pages of one PDF may draw together.")
    render_max_per_key: int = Field(
        1, ge=1, description="Documents one API key may have rendering at once (embedded server).")
    # --- jobs and queue ------------------------------------------------------------------------------------------
    embedded_jobs: int = Field(0, ge=0, description="Jobs `docpipe process` runs at once (the engine batches "
                               "their pages together); 0 = 4 on reference, the engine's job slots on cuda.")
    embedded_renders: int = Field(0, ge=0, description="Files `docpipe process` reads and renders at once (each "
                                  "in a render process of its own); 0 = half the CPUs, 1 to 8.")
    broker_url: str | None = Field(None, description="Celery broker (redis://...); None = embedded in-process runs.")
    job_lease_s: float = Field(900.0, gt=0, description="A running job whose lease passed may be taken over.")
    job_max_attempts: int = Field(3, ge=1, description="Attempts before a job is failed for good (poison cap).")
    # --- folder ingestion ----------------------------------------------------------------------------------------
    watch_folders: Annotated[list[Path], NoDecode] = Field(default_factory=list, description="Folders beat ingests.")
    watch_action: WatchAction = Field("leave", description="After processing: leave files, or move to done/|failed/.")
    stable_seconds: float = Field(2.0, ge=0, description="A file must keep size and mtime this long to be taken.")
    # --- API ----------------------------------------------------------------------------------------------------
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Accepted API keys, each 'key' (default tenant), 'tenant:key' or '*:key' "
        "(admin: every tenant); empty = none.")
    api_host: str = Field("127.0.0.1", description="Address `docpipe serve` binds.")
    api_port: int = Field(8000, ge=1, le=65535, description="Port `docpipe serve` binds.")
    api_rate_limit_per_minute: int = Field(120, ge=1, description="Requests per minute per API key.")
    api_max_inflight_per_key: int = Field(32, ge=1, description="Queued/running jobs one tenant may hold (all its "
                                          "keys together; checked atomically with the upload).")
    ready_max_queued_jobs: int = Field(
        1000, ge=1, description="/readyz answers 503 (queue saturated) when more jobs than this are queued.")
    api_header_timeout_s: float = Field(
        10.0, gt=0, le=300, description="`docpipe serve`: a request line and headers must arrive within this of the "
        "connection opening (or of the previous response), else the connection is closed.")
    api_keep_alive_timeout_s: int = Field(
        5, ge=1, le=300, description="`docpipe serve`: an idle keep-alive connection is closed after this.")
    api_max_connections: int | None = Field(
        None, ge=16, le=65536, description="`docpipe serve`: open connections per server process; more are closed "
        "at accept. None = half the process's file-descriptor limit, at most 4096.")
    retention_days: int | None = Field(None, ge=1, description="Purge documents older than this; None = keep.")

    @field_validator("watch_folders", "api_keys", mode="before")
    @classmethod
    def _lists_from_env(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("api_keys")
    @classmethod
    def _keys_not_trivial(cls, keys: list[str]) -> list[str]:
        from .tenancy import parse_key_entries

        parse_key_entries(keys)  # raises naming the entry by position, never echoing a key
        return keys

    def api_key_entries(self) -> list[Any]:
        """The configured keys with their tenants (`pipeline.tenancy.KeyEntry`)."""
        from .tenancy import parse_key_entries

        return parse_key_entries(self.api_keys)

    @model_validator(mode="after")
    def _data_dir_absolute(self) -> "Settings":
        # Resolve once so a later chdir (tests, daemons) cannot move the data dir.
        object.__setattr__(self, "data_dir", self.data_dir.expanduser().resolve())
        return self

    # --- derived values -------------------------------------------------------------------------------------------
    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'docpipe.sqlite'}"

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def embedded(self) -> bool:
        """True when jobs run in this process (no broker configured)."""
        return self.broker_url is None

    def resolved_model_dir(self) -> Path:
        if self.model_dir is not None:
            return self.model_dir.expanduser().resolve()
        from gpu_engine.bundled import bundled_model_dir  # imported late: only needed when a model is used

        return Path(bundled_model_dir())

    def engine_batch(self) -> tuple[int, int]:
        """(max_num_seqs, max_batched_tokens) for gpu_engine.EngineConfig: the settings where given; else the small
        reference-runner defaults; else 0 (EngineConfig's AUTO: the cuda engine sizes them itself)."""
        seqs, tokens = self.engine_max_num_seqs, self.engine_max_batched_tokens
        if self.runner == "reference":
            seqs = seqs or REFERENCE_MAX_NUM_SEQS
            tokens = tokens or max(REFERENCE_MAX_BATCHED_TOKENS, seqs)
        if seqs and tokens:
            tokens = max(tokens, seqs)  # every running sequence advances each step
        return seqs, tokens

    def engine_job_slots(self) -> int:
        """Sequences the engine may run at once, known before it is built (the GPU worker's job threads, the API's
        per-key engine cap): the setting, the reference default, or on cuda the most the engine sizes itself to."""
        from gpu_engine.batch_defaults import MAX_SIZED_NUM_SEQS  # imported late, as bundled_model_dir

        return self.engine_batch()[0] or MAX_SIZED_NUM_SEQS

    def pages_in_flight(self, engine_max_num_seqs: int) -> int:
        """Page requests one process keeps at the engine at once, over all its jobs (pipeline.page_feed), given
        the engine's batch as built: the setting, else PAGES_IN_FLIGHT_PER_BATCH batches. So 12 jobs of 10 pages
        have all 120 pages at an engine batching 256, and 256 jobs hold ~512 pages (~27 GB of pixels), not 2,560."""
        return self.engine_pages_in_flight or max(1, PAGES_IN_FLIGHT_PER_BATCH * engine_max_num_seqs)

    def prep_processes(self) -> int:
        """Page preparation processes of a process that builds an engine (engine_prep_processes resolved)."""
        if self.engine_prep_processes is not None:
            return self.engine_prep_processes
        if self.runner == "reference":
            return 0
        from .threads import usable_cpus  # imported late, as bundled_model_dir

        return max(1, min(PREP_PROCESSES_MAX, usable_cpus() // 4))

    def embedded_job_threads(self) -> int:
        """Jobs `docpipe process` runs at once: the setting, else 4 on the reference runner (a small CPU), else as
        many as the GPU worker runs (engine_job_slots), so the pages in flight can fill the engine's batch."""
        if self.embedded_jobs:
            return self.embedded_jobs
        return REFERENCE_EMBEDDED_JOBS if self.runner == "reference" else self.engine_job_slots()

    def embedded_render_threads(self) -> int:
        """Files `docpipe process` takes in at once: the setting, else half the CPUs (1 to 8). Each render runs
        in its own process and the thread only waits on it, so several keep the intake ahead of a fast engine."""
        return self.embedded_renders or max(1, min(8, (os.cpu_count() or 2) // 2))

    def engine_quantize_option(self) -> str | None:
        """`quantize` for gpu_engine.load / Engine.from_pretrained: None for "none"."""
        return None if self.engine_quantize == "none" else self.engine_quantize

    def grammar_caps(self) -> tuple[int | None, int | None]:
        """(max string length, max array items) for the decoding grammar. The bundled model has random weights:
        it writes noise until a string's maxLength, so unless told otherwise its answers are kept short."""
        bundled = self.model_dir is None
        length = self.grammar_max_string_length
        items = self.grammar_max_array_items
        if bundled and length is None:
            length = BUNDLED_MAX_STRING_LENGTH
        if bundled and items is None:
            items = BUNDLED_MAX_ARRAY_ITEMS
        return length, items

    def media_limits(self) -> Any:
        """The `vision.MediaLimits` these settings describe."""
        from vision.limits import MediaLimits

        return MediaLimits(
            max_file_bytes=self.max_file_bytes,
            max_pages=self.max_pages,
            max_page_pixels=self.max_page_pixels,
            max_photo_pixels=self.max_photo_pixels,
            max_video_seconds=self.max_video_seconds,
            page_render_timeout_s=self.page_render_timeout_s,
            document_render_timeout_s=self.document_render_timeout_s,
            max_page_draw_ops=self.max_page_draw_ops,
            max_document_draw_ops=self.max_document_draw_ops,
        )

    def render_options(self) -> Any:
        """The `vision.RenderOptions` these settings describe. Video frames are chosen by the engine's sampling
        rule (its one home), so the engine takes them as they come instead of sampling them again."""
        from gpu_engine.frame_sampling import QwenFrameSampler
        from vision.limits import RenderOptions

        sampler = QwenFrameSampler(fps=self.video_fps, max_frames=self.video_max_frames)
        return RenderOptions(pdf_dpi=self.pdf_dpi, frame_sampler=sampler)


SECRET_FIELDS = frozenset({"api_keys", "database_url", "broker_url"})


def settings_rows(settings: Settings | None = None) -> list[dict[str, str]]:
    """One row per setting: name, env var, default, description and (given settings) the current value, with
    secrets masked. Feeds `docpipe config` and the README's table."""
    rows = []
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        row = {"name": name, "env": f"DOCPIPE_{name.upper()}", "default": _show(default),
               "description": field.description or ""}
        if settings is not None:
            value = getattr(settings, name)
            row["value"] = _mask(name, value)
        rows.append(row)
    return rows


def _show(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "(empty)"
    return str(value)


def _mask(name: str, value: Any) -> str:
    if name == "api_keys":
        return f"{len(value)} key(s)" if value else "(none)"
    if name in SECRET_FIELDS and isinstance(value, str) and "@" in value:
        scheme, _, rest = value.partition("://")
        creds, _, host = rest.rpartition("@")
        return f"{scheme}://{creds.split(':')[0]}:***@{host}" if ":" in creds else value
    return _show(value)


def get_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with keyword overrides (used by the CLI and tests)."""
    return Settings(**overrides)
