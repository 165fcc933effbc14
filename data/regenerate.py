"""Self-distillation: the target re-answers every user turn, so the drafter learns the target's own outputs.

Two ways to run the target: an OpenAI-compatible endpoint (what `sglang.launch_server` exposes), with
concurrency and retries, or transformers `generate` in this process, batched across conversations. The output
is a conversation JSONL in input order; a re-run resumes from it. The report's succeeded + errors + skipped
equals the input count.

    python -m data.regenerate --config run.yaml      (the pipeline's regenerate stage; `python -m data` runs
                                                      it too when it has not run)
"""
from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Protocol

import requests
from tqdm import tqdm

from .config import EyrieConfig, RegenerateConfig
from .conversations import Conversation, SkipReport, load_conversations
from .files import atomic_write_json
from .layout import partial_of, report_of

REGENERATABLE_ROLES = {"system", "user", "assistant"}


class Reply(dict):
    """{'content': str, 'reasoning_content': str | None, 'finish_reason': str}"""


class Generator(Protocol):
    def __call__(self, messages: list[dict], tools: list[dict] | None = None) -> Reply: ...


class RetryableError(RuntimeError):
    pass


class OpenAIChatGenerator:
    """POST {endpoint}/chat/completions, retrying connection errors, 429 and 5xx with backoff."""

    def __init__(self, cfg: RegenerateConfig, sleep: Callable[[float], None] = time.sleep,
                 template_kwargs: dict | None = None):
        self.cfg, self.sleep, self.template_kwargs = cfg, sleep, dict(template_kwargs or {})
        self.url = cfg.endpoint.rstrip("/") + "/chat/completions"
        self.session = requests.Session()

    def _once(self, messages: list[dict], tools: list[dict] | None) -> Reply:
        body = {"model": self.cfg.model, "messages": messages, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature} | ({"tools": tools} if tools else {}) | \
            ({"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {})
        try:
            resp = self.session.post(self.url, json=body, timeout=self.cfg.timeout_s)
        except (requests.ConnectionError, requests.Timeout) as e:
            raise RetryableError(f"{self.url}: {type(e).__name__}: {e}") from None
        if resp.status_code == 429 or resp.status_code >= 500:
            raise RetryableError(f"{self.url}: HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code != 200:
            raise RuntimeError(f"{self.url}: HTTP {resp.status_code}: {resp.text[:200]}")
        choice = resp.json()["choices"][0]
        msg = choice["message"]
        return Reply(content=msg.get("content") or "", reasoning_content=msg.get("reasoning_content"),
                     finish_reason=choice.get("finish_reason") or "stop")

    def __call__(self, messages: list[dict], tools: list[dict] | None = None) -> Reply:
        for attempt in range(self.cfg.max_retries + 1):
            try:
                return self._once(messages, tools)
            except RetryableError:
                if attempt == self.cfg.max_retries:
                    raise
                self.sleep(min(2.0 ** attempt, 30.0))
        raise AssertionError("unreachable")


class LocalGenerator:
    """transformers `generate` on the target, greedy unless a temperature is set. `generate_batch` answers
    several histories in one left-padded batch: on a GPU one prompt at a time leaves a small target
    launch-bound (the tiny DeepseekV3 demo's 400 prompts: 96 s on the H200, slower than on the CPU)."""

    def __init__(self, model_path: str, cfg: RegenerateConfig, trust_remote_code: bool = False,
                 template_kwargs: dict | None = None):
        self.model_path, self.cfg, self.trust_remote_code = model_path, cfg, trust_remote_code
        self.template_kwargs = dict(template_kwargs or {})
        self.model = None  # loaded on the first request: a resumed run with nothing left loads nothing

    def _load(self) -> None:
        import torch
        from transformers import AutoTokenizer

        from .target import load_causal_lm
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        cuda = torch.cuda.is_available()
        self.model = load_causal_lm(self.model_path, torch.bfloat16 if cuda else torch.float32,
                                    "cuda" if cuda else "cpu", self.trust_remote_code)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = {self.tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos])
        self.eos_ids.discard(None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id

    def __call__(self, messages: list[dict], tools: list[dict] | None = None) -> Reply:
        return self.generate_batch([messages], [tools])[0]

    def generate_batch(self, histories: list[list[dict]], tools: list[list[dict] | None] | None = None
                       ) -> list[Reply]:
        if self.model is None:
            self._load()
        torch = self.torch
        prompts = [self.tokenizer.apply_chat_template(h, tools=t, add_generation_prompt=True, return_dict=True,
                                                      **self.template_kwargs)["input_ids"]
                   for h, t in zip(histories, tools or [None] * len(histories))]
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        sampling = {"do_sample": True, "temperature": self.cfg.temperature} if self.cfg.temperature > 0 else \
            {"do_sample": False}
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=self.cfg.max_new_tokens,
                                      pad_token_id=self.pad_id, **sampling)
        replies = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), None)  # a finished row is padded
            text = self.tokenizer.decode(row[:end], skip_special_tokens=True)
            replies.append(Reply(content=text, reasoning_content=None,
                                 finish_reason="length" if end is None else "stop"))
        return replies


def regenerate_conversations(convs: list[Conversation],
                             generate_batch: Callable[[list[list[dict]], list], list[Reply]],
                             keep_reasoning: bool) -> list[tuple[Conversation, int]]:
    """Replace every assistant turn by the target's answer to the history before it. The conversations advance
    together, turn by turn, so each turn is one `generate_batch` call. Returns (conversation, replies truncated)."""
    histories: list[list[dict]] = [[] for _ in convs]
    truncated, position = [0] * len(convs), [0] * len(convs)
    while True:
        waiting = []
        for i, conv in enumerate(convs):
            while position[i] < len(conv.messages) and conv.messages[position[i]]["role"] != "assistant":
                msg = conv.messages[position[i]]
                histories[i].append({"role": msg["role"], "content": msg["content"]})
                position[i] += 1
            if position[i] < len(conv.messages):
                waiting.append(i)
        if not waiting:
            return [(dataclasses.replace(c, messages=h), t) for c, h, t in zip(convs, histories, truncated)]
        replies = generate_batch([list(histories[i]) for i in waiting], [convs[i].tools for i in waiting])
        for i, reply in zip(waiting, replies, strict=True):
            new = {"role": "assistant", "content": reply["content"]}
            if keep_reasoning and reply.get("reasoning_content"):
                new["reasoning_content"] = reply["reasoning_content"]
            truncated[i] += reply.get("finish_reason") == "length"
            histories[i].append(new)
            position[i] += 1


def unsupported_roles(conv: Conversation) -> set[str]:
    """Roles a conversation has that regeneration cannot replay (it is skipped and counted)."""
    return {m["role"] for m in conv.messages} - REGENERATABLE_ROLES


def finished_rows(out_path: Path) -> dict[str, dict]:
    """What earlier runs regenerated, by conversation id: the finished file and a killed run's partial one."""
    done: dict[str, dict] = {}
    for path in (out_path, partial_of(out_path)):
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill; that conversation is simply redone
                done[row["id"]] = row
    return done


def regenerate(conversations: list[Conversation], generate: Generator, out_path: str | Path,
               cfg: RegenerateConfig, concurrency: int | None = None) -> dict:
    """Regenerate into `out_path` (JSONL), resuming from what it already holds; returns the report."""
    out_path = Path(out_path)
    partial = partial_of(out_path)
    done = finished_rows(out_path)
    report = {"input": len(conversations), "succeeded": 0, "resumed": 0, "errors": 0, "skipped": 0,
              "truncated_replies": 0, "error_examples": [], "skipped_reasons": {}}
    todo = []
    for conv in conversations:
        unsupported = unsupported_roles(conv)
        if unsupported:
            reason = "unsupported_role:" + ",".join(sorted(unsupported))
            report["skipped"] += 1
            report["skipped_reasons"][reason] = report["skipped_reasons"].get(reason, 0) + 1
        elif conv.id in done:
            report["resumed"] += 1
        else:
            todo.append(conv)
    # A generator with generate_batch (local) answers a batch of conversations per turn, one batch at a time;
    # an endpoint gets one conversation per worker, `concurrency` in flight.
    width = concurrency or cfg.concurrency
    batched = getattr(generate, "generate_batch", None)
    if batched is not None:
        chunks, workers = [todo[i:i + width] for i in range(0, len(todo), width)], 1
    else:
        chunks, workers = [[c] for c in todo], width
        batched = lambda histories, tools: [generate(h, t) for h, t in zip(histories, tools)]  # noqa: E731
    with open(partial, "a", encoding="utf-8") as sink, ThreadPoolExecutor(max_workers=workers) as pool, \
            tqdm(total=len(todo), desc="regenerate", unit="conv") as bar:
        futures = {pool.submit(regenerate_conversations, chunk, batched, cfg.keep_reasoning): chunk
                   for chunk in chunks}
        for fut in as_completed(futures):
            chunk = futures[fut]
            bar.update(len(chunk))
            try:
                results = fut.result()
            except Exception as e:  # counted and reported per conversation; the next run retries them
                report["errors"] += len(chunk)
                if len(report["error_examples"]) < 20:
                    which = chunk[0].id if len(chunk) == 1 else \
                        f"{chunk[0].id}..{chunk[-1].id} ({len(chunk)} in one batch)"
                    report["error_examples"].append(f"{which}: {type(e).__name__}: {e}")
                continue
            for new, truncated in results:
                row = {"id": new.id, "messages": new.messages} | ({"heldout": new.heldout} if new.heldout else {}) \
                    | ({"tools": new.tools} if new.tools else {})
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
                done[new.id] = row
                report["succeeded"] += 1
                report["truncated_replies"] += truncated
            sink.flush()
    report["succeeded"] += report["resumed"]
    # Final file in input order, so reruns and resumes give identical output.
    ordered = [done[c.id] for c in conversations if c.id in done]
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered), encoding="utf-8")
    tmp.replace(out_path)
    partial.unlink(missing_ok=True)
    assert report["succeeded"] + report["errors"] + report["skipped"] == report["input"]
    atomic_write_json(report_of(out_path), report)
    return report


def pending(cfg: EyrieConfig) -> int:
    """How many conversations the regenerate stage still has to answer; 0 needs no model and no server."""
    done = finished_rows(cfg.layout.regenerated)
    convs = load_conversations(cfg.data.inputs, SkipReport(), cfg.data.skip_malformed)
    return sum(c.id not in done and not unsupported_roles(c) for c in convs)


def run(cfg: EyrieConfig) -> dict:
    """The regenerate stage: the target answers every prompt again → RUN_DIR/data/regenerated.jsonl (resumable;
    with nothing left to do it loads no model). The data stage tokenizes that file instead of data.inputs."""
    source = SkipReport()
    convs = list(load_conversations(cfg.data.inputs, source, cfg.data.skip_malformed))
    rc = cfg.data.regenerate
    kwargs = cfg.data.chat_template_kwargs
    unrendered = unrendered_in_prompts(convs, cfg)
    generate = OpenAIChatGenerator(rc, template_kwargs=kwargs) if rc.backend == "openai" else \
        LocalGenerator(cfg.target.path, rc, cfg.target.trust_remote_code, template_kwargs=kwargs)
    out = cfg.layout.regenerated
    out.parent.mkdir(parents=True, exist_ok=True)
    result = regenerate(convs, generate, out, rc)
    print(f"regenerate: source {source.summary()}")
    if unrendered:
        print("regenerate: left out of the prompts by the chat template (the target answered without them): "
              + ", ".join(f"{k}={v}" for k, v in unrendered.items()))
    print(f"regenerate: {result['succeeded']} succeeded ({result['resumed']} resumed), {result['errors']} errors, "
          f"{result['skipped']} skipped of {result['input']}; {result['truncated_replies']} replies hit max_new_tokens")
    return {"source": source.to_json(), **result, "unrendered_by_template": unrendered}


def unrendered_in_prompts(convs: list[Conversation], cfg: EyrieConfig) -> dict[str, int]:
    """Per reason, the conversations whose first prompt, rendered with the target's chat template (what the
    local backend renders, and what a server of the target renders), leaves out their declared tools."""
    from transformers import AutoTokenizer

    from .chat import ChatTokenizer
    with_tools = [c for c in convs if c.tools]
    if not with_tools:
        return {}
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(cfg.target.tokenizer_path,
                                                       trust_remote_code=cfg.target.trust_remote_code),
                         template_kwargs=cfg.data.chat_template_kwargs)
    counts: dict[str, int] = {}
    for conv in with_tools:
        first = next((i for i, m in enumerate(conv.messages) if m["role"] == "assistant"), len(conv.messages))
        prompt = [{"role": m["role"], "content": m["content"]} for m in conv.messages[:first]]
        text = chat.render(prompt, True, conv.tools)
        for reason in chat.unrendered(dataclasses.replace(conv, messages=prompt), text):
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> None:
    from .config import cli_config
    cfg, _ = cli_config("regenerate", "Eyrie regenerate stage: the target answers the conversations' prompts again.", argv)
    if not cfg.data.regenerate.enabled:
        raise SystemExit("data.regenerate.enabled is false: nothing to regenerate")
    run(cfg)


if __name__ == "__main__":
    from .config import stage_errors
    with stage_errors("regenerate"):
        main()
