"""Turn 2 of a two-turn chat on Qwen2.5-Coder-1.5B at T=0: time to first token and decode tok/s, ngram vs none.

Run: .venv/bin/python benchmarks/two_turn_chat.py (interleaves 3 repeats of each mode)."""
import statistics, time, json
from edgespec import ChatSession, SamplingParams, Step, Done
from edgespec.loading import load_engine

engine = load_engine("qwen2.5-coder-1.5b-instruct", "ngram", n_ctx=4096)
turn1 = ("Write a Python function `parse_log_line(line)` that parses an nginx access log line "
         "into a dict with ip, time, method, path, status and size, using a regular expression. "
         "Only the code, no explanation.")
turn2 = "Change it so that status and size are returned as integers. Show the whole function again."
params = SamplingParams(temperature=0.0, max_tokens=150)
rows = []
for rep in range(3):
    for mode in ("none", "ngram") if rep % 2 == 0 else ("ngram", "none"):
        engine.set_mode(mode)
        engine.forget_cache()
        session = ChatSession(engine)
        first = session.send(turn1, params)
        start = time.perf_counter(); ttft = None
        for event in session.stream(turn2, SamplingParams(temperature=0.0, max_tokens=250)):
            if isinstance(event, Step) and ttft is None and event.tokens:
                ttft = time.perf_counter() - start
            if isinstance(event, Done):
                s = event.result.stats; ids = event.result.token_ids
        rows.append(dict(mode=mode, rep=rep, turn1_tokens=first.stats["tokens_generated"], ttft=ttft,
                         tok_s=s["decode_tokens_per_second"], acc=s["acceptance_rate"], ppt=s["target_passes_per_token"],
                         reused=s["prompt_tokens_reused"], evaluated=s["prompt_tokens_evaluated"], tokens=s["tokens_generated"], ids=ids))
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items() if k != "ids"}, flush=True)
for mode in ("none", "ngram"):
    r = [x for x in rows if x["mode"] == mode]
    print(mode, "median TTFT", round(statistics.median(x["ttft"] for x in r), 3), "median tok/s", round(statistics.median(x["tok_s"] for x in r), 2))
print("turn-2 ids identical across modes:", len({tuple(x["ids"]) for x in rows}) == 1)
print("turn-1 tokens:", rows[0]["turn1_tokens"])
