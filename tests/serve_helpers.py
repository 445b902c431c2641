"""A real HTTP server in this process: `build_app(engine)` under uvicorn in a background thread, on a free port of
127.0.0.1. Tests talk to it with the `openai` client or httpx, and read the engine's state directly."""

from __future__ import annotations

import socket
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """`with ThreadedServer(app) as base_url:` serves `app` until the block ends (then shuts it down)."""

    def __init__(self, app, startup_timeout: float = 60.0) -> None:
        import uvicorn

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.startup_timeout = startup_timeout

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return self.base
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def tiny_replica(device: str):
    """(model, tokenizer) of a data-parallel test replica (`ReplicaSpec.load`): the seeded tiny Llama of the server
    tests with the byte tokenizer, the same in every replica process."""
    from hf_paged.testing import byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    return tiny_model("llama", vocab_size=len(tok)).to(device), tok


def broken_replica(device: str):
    """A replica loader that fails (a model that cannot be loaded): the router must refuse to start."""
    raise OSError(f"no model to load on {device}")
