"""A real OpenAI-compatible chat server for tests: a tiny transformers model behind a real socket.

Faults can be injected (`fail_first` requests answer 503; a user message containing "POISON" answers 400),
so retry and error accounting are tested against real HTTP.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class ChatServer:
    def __init__(self, model, tokenizer, fail_first: int = 0):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.fail_first, self.requests = fail_first, 0
        self.bodies: list[dict] = []  # every request body that reached the model
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload = server.handle(self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def handle(self, path: str, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.requests += 1
            if self.requests <= self.fail_first:
                return 503, {"error": "warming up"}
        if path != "/v1/chat/completions":
            return 404, {"error": f"no route {path}"}
        if any("POISON" in m["content"] for m in body["messages"]):
            return 400, {"error": "rejected prompt"}
        self.bodies.append(body)
        # as SGLang's OpenAI server does: tools and chat_template_kwargs reach the template
        ids = self.tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True,
                                                 **body.get("chat_template_kwargs", {}))["input_ids"]
        with self.lock, torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=body.get("max_tokens", 16), do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        finish = "stop" if new and new[-1] == self.tokenizer.eos_token_id else "length"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return 200, {"choices": [{"index": 0, "finish_reason": finish,
                                  "message": {"role": "assistant", "content": text}}]}

    def __enter__(self) -> "ChatServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
