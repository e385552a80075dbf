"""FakeSGLangServer: a recorded-protocol stand-in for SGLang's HTTP server, NOT the engine.

It answers SGLang's native endpoints with the request/response shapes of SGLang's documented API
(``/generate`` with ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]`` triples,
``finish_reason`` as ``{"type": ...}``, ``{"success", "message"}`` for control endpoints) and
records every request so contract tests can assert what the adapter sends. Tokens are a
deterministic function of the input ids so tests can predict them; it models nothing else.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def fake_token(input_ids: list[int], i: int) -> int:
    return (sum(input_ids) * 31 + i * 7) % 40 + 4


class FakeSGLangServer:
    """Serve on 127.0.0.1 (random port) in a thread; ``token_delay_s`` slows /generate for abort tests."""

    def __init__(self, token_delay_s: float = 0.0) -> None:
        self.token_delay_s = token_delay_s
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.aborted: set[str] = set()
        self.fail_next: dict[str, str] = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n) or b"{}")
                with outer._lock:
                    outer.requests.append((self.path, body))
                    fail = outer.fail_next.pop(self.path, None)
                if fail is not None:
                    self._json({"success": False, "message": fail})
                    return
                if self.path == "/generate":
                    self._json(outer._generate(body))
                elif self.path == "/abort_request":
                    with outer._lock:
                        outer.aborted.add(body.get("rid", ""))
                    self._json({})
                elif self.path == "/flush_cache":
                    self.send_response(200)
                    self.end_headers()
                elif self.path in (
                    "/update_weights_from_tensor",
                    "/init_weights_update_group",
                    "/update_weights_from_distributed",
                    "/release_memory_occupation",
                    "/resume_memory_occupation",
                ):
                    self._json({"success": True, "message": "Succeeded"})
                else:
                    self.send_response(404)
                    self.end_headers()

            def _json(self, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = body["input_ids"]
        sp = body.get("sampling_params", {})
        rid = body.get("rid", "")
        stops = set(sp.get("stop_token_ids") or [])
        out: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": sp.get("max_new_tokens", 128)}
        for i in range(sp.get("max_new_tokens", 128)):
            with self._lock:
                if rid in self.aborted:
                    finish = {"type": "abort", "message": "Abort request"}
                    break
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            t = fake_token(ids, i)
            out.append(t)
            if t in stops:
                finish = {"type": "stop", "matched": t}
                break
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.25 - 0.01 * (t % 5), t, None] for t in out]
        return {"output_ids": out, "meta_info": meta}

    def __enter__(self) -> FakeSGLangServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def calls(self, path: str) -> list[dict[str, Any]]:
        with self._lock:
            return [b for p, b in self.requests if p == path]
