"""`Pipeline`: the settings, database, blob store and (lazily) engine client one process works with.

Workers and the API build one per process and pass it to the library functions (`ingest_file`, `run_job`, ...).
The engine is only built when a job actually runs, so an API process that only enqueues never loads weights.
"""
from __future__ import annotations

import threading

from .blobs import BlobStore
from .db import Database
from .engine_client import ExtractionClient, model_key, model_key_for_id, shared_client
from .errors import ModelNotAvailableError
from .image_cache import ImageCache
from .page_feed import PageSlots
from .settings import Settings


class Pipeline:
    def __init__(
        self,
        settings: Settings | None = None,
        *,
        client: ExtractionClient | None = None,
        database: Database | None = None,
        migrate: bool = True,
    ) -> None:
        self.settings = settings or Settings()
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.db = database or Database(self.settings.resolved_database_url)
        self.blobs = BlobStore(self.settings.blob_dir)
        self.images = ImageCache(self.settings.image_cache_bytes)
        self._client = client
        self._page_slots: PageSlots | None = None
        self._page_slots_lock = threading.Lock()
        self._model_key: str | None = client.model_key if client is not None else None
        if migrate:
            self.db.upgrade()  # cheap when already at head; a fresh data dir just works
        from .schemas import ensure_builtin_schemas

        with self.db.session() as session:
            ensure_builtin_schemas(session)

    @property
    def client(self) -> ExtractionClient:
        """The engine client (built on first use; one per process and model)."""
        if self._client is None:
            self._client = shared_client(self.settings)
        return self._client

    @property
    def page_slots(self) -> PageSlots:
        """The bound on page requests this process's jobs keep at the engine together (Settings.pages_in_flight),
        sized from the engine's batch once the client exists."""
        with self._page_slots_lock:
            if self._page_slots is None:
                seqs = getattr(self.client, "max_num_seqs", 0) or self.settings.engine_job_slots()
                self._page_slots = PageSlots(self.settings.pages_in_flight(seqs))
            return self._page_slots

    @property
    def model_key(self) -> str:
        """Identity of the configured model, known without loading it (jobs are deduped on it)."""
        if self._model_key is None:
            if self.settings.model_id:
                self._model_key = model_key_for_id(self.settings.model_id, self.settings.engine_quantize_option())
            else:
                folder = self.settings.resolved_model_dir()
                try:
                    self._model_key = model_key(folder, self.settings.engine_quantize_option())
                except OSError as exc:
                    raise ModelNotAvailableError(
                        f"the model folder {folder} cannot be read on this host ({exc}); point DOCPIPE_MODEL_DIR at "
                        "the checkpoint, or on hosts without the weights name the model with DOCPIPE_MODEL_ID"
                    ) from exc
        return self._model_key

    def close(self) -> None:
        self.db.dispose()
