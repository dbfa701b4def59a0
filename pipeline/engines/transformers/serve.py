"""The reference engine's process: one checkpoint loaded by transformers, served over the OpenAI completions API.

    python -m pipeline.engines.transformers.serve --model DIR --port P [--dtype float32] [--tokenizer DIR]

It answers what lm-eval's local-completions backend asks of an engine (interface.py's contract): prompts as
token ids or text, `echo` with `logprobs` (each prompt token's log-probability and the top-1 beside it) for
log-likelihoods, greedy generation up to `max_tokens` cut at the first `stop` string. It is a second opinion
on the numbers, not a server to measure: one request at a time, each prompt alone in its forward pass, so
its answers do not depend on what else is in flight. Compressed-tensors checkpoints are decompressed by
compressed-tensors itself (a path independent of the pipeline's own dequantization), and a scheme that
quantizes activations runs them through compressed-tensors' own quantize-dequantize.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def load(model: Path, dtype: str, tokenizer: Path | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar per load in the log, no information
    kw = {}
    qc = json.loads((model / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        # weights decompressed as they load; the scheme's activation quantization (if any) stays in the forward
        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), **kw).eval()
    tok = AutoTokenizer.from_pretrained(tokenizer or model)
    return m, tok


class Model:
    def __init__(self, model, tok, served_name: str):
        import torch

        self.torch, self.model, self.tok, self.served_name = torch, model, tok, served_name
        self.lock = threading.Lock()  # one forward at a time: the answers never depend on concurrency
        self.finished = 0
        self.running = 0

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tok(prompt, add_special_tokens=False)["input_ids"]
        return [int(t) for t in prompt]

    def _piece(self, t: int) -> str:
        return self.tok.convert_ids_to_tokens(int(t))

    def complete(self, body: dict) -> dict:
        prompts = body["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        choices = []
        for i, p in enumerate(prompts):
            with self.lock:
                self.running += 1
                try:
                    choices.append({"index": i, **self._one(self._ids(p), body)})
                finally:
                    self.running -= 1
                    self.finished += 1
        return {"object": "text_completion", "model": self.served_name, "choices": choices}

    def _one(self, ids: list[int], body: dict) -> dict:
        torch = self.torch
        max_tokens = int(body.get("max_tokens") or 16)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        k = max(1, int(body.get("logprobs") or 1))  # top-k log-probabilities per position, as vLLM returns them

        def piece(t: int) -> str:  # "token_id:N" where asked (the drift suite), as vLLM's option does
            return f"token_id:{int(t)}" if body.get("return_tokens_as_token_ids") else self._piece(t)

        def top(row) -> dict:
            vals, idx = torch.topk(row, k)
            return {piece(int(a)): float(v) for v, a in zip(vals, idx, strict=True)}

        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), use_cache=True)
            logp = torch.log_softmax(out.logits[0].float(), dim=-1)
            past = out.past_key_values
            gen: list[int] = []
            gen_lp: list[float] = []
            gen_top: list[dict] = []
            last = logp[-1]
            text, finish = "", "length"
            while len(gen) < max_tokens:
                t = int(torch.argmax(last))
                gen.append(t)
                gen_lp.append(float(last[t]))
                gen_top.append(top(last))
                # the end of sequence, or a stop string that is a special token (decoding skips those)
                if t == self.tok.eos_token_id or self._piece(t) in stop:
                    gen.pop(), gen_lp.pop(), gen_top.pop()
                    finish = "stop"
                    break
                text = self.tok.decode(gen, skip_special_tokens=True)
                cut = [text.index(s) for s in stop if s and s in text]
                if cut:
                    text, finish = text[:min(cut)], "stop"
                    break
                if len(gen) == max_tokens:
                    break
                out = self.model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past, last = out.past_key_values, torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        logprobs = None
        if body.get("logprobs") is not None:
            toks = ids + gen if body.get("echo") else gen
            lps = ([None] + [float(logp[j, ids[j + 1]]) for j in range(len(ids) - 1)] if body.get("echo") else [])
            tops = [None] + [top(logp[j]) for j in range(len(ids) - 1)] if body.get("echo") else []
            logprobs = {"tokens": [piece(t) for t in toks], "token_logprobs": lps + gen_lp,
                        "top_logprobs": tops + gen_top}
        if body.get("echo"):
            text = self.tok.decode(ids) + text
        return {"text": text, "logprobs": logprobs, "finish_reason": finish}


def handler(model: Model):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # one line per request would drown the log
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model.served_name, "object": "model"}]})
            elif self.path == "/gauges":
                self._send(200, {"running": model.running, "waiting": 0, "kv_usage": 0.0, "preemptions": 0,
                                 "finished": model.finished})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._send(404, {"error": self.path})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._send(200, model.complete(body))
            except Exception as exc:  # the client sees the engine's reason, as vLLM answers 400/500
                self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})

    return Handler


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--served-name", default="model")
    a = ap.parse_args(argv)
    print(f"reference engine: loading {a.model} with transformers in {a.dtype}", flush=True)
    m, tok = load(a.model, a.dtype, a.tokenizer)
    print("reference engine: loaded; serving", flush=True)
    ThreadingHTTPServer(("127.0.0.1", a.port), handler(Model(m, tok, a.served_name))).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
