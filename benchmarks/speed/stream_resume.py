"""Time to resume a streamed text run (``data.kind text`` from parquet) late in its pass, from the checkpoint's
saved position and by replaying the pass (a checkpoint without positions), on the CPU.

    python benchmarks/speed/stream_resume.py [--docs 200000] [--stop 0.9] [--buffer 1000] [--out FILE.json]

A synthetic corpus of ``--docs`` documents (word-level tokenizer) is written to a temporary directory; a run
reads up to ``--stop`` of its first pass, saves its state, and two fresh streams resume from it. Both must read
the same next windows (checked); the JSON gives the seconds each took and the documents each tokenized.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def corpus(root: Path, docs: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = np.random.default_rng(0)
    words = rng.integers(0, 1000, size=(docs, 48))
    texts = [" ".join(f"w{w}" for w in row[: 8 + i % 40]) for i, row in enumerate(words)]
    pq.write_table(pa.table({"text": texts}), str(root / "train.parquet"), row_group_size=8192)
    tk = Tokenizer(models.WordLevel({"<eos>": 0} | {f"w{i}": i + 1 for i in range(1000)}, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return root / "train.parquet", root / "tokenizer.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--stop", type=float, default=0.9, help="where in the first pass the run stops")
    ap.add_argument("--buffer", type=int, default=1000, help="data.shuffle_buffer")
    ap.add_argument("--seq-len", type=int, default=1023)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from megaseq.config import DataConfig
    from megaseq.data import build_data
    from megaseq.data.tokenizer import HfTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        train_path, tok = corpus(Path(tmp), args.docs)
        cfg = DataConfig(kind="text", tokenizer=str(tok), train=[str(train_path)], seq_len=args.seq_len,
                         shuffle_buffer=args.buffer)
        fresh = build_data(cfg).train
        per_pass = sum(1 for _ in fresh.make_stream(0))
        run = copy.copy(fresh)
        for _ in range(int(per_pass * args.stop)):
            run.next_windows()
        state = json.loads(json.dumps(run.state_dict()))
        want = run.next_windows()
        tokenized = [0]
        real = HfTokenizer.encode_batch

        def counted(self, texts):
            tokenized[0] += len(texts)
            return real(self, texts)

        HfTokenizer.encode_batch = counted
        out = {"docs": args.docs, "windows_per_pass": per_pass, "stop_step": int(per_pass * args.stop),
               "shuffle_buffer": args.buffer, "seq_len": args.seq_len}
        for name, saved in (("position", state), ("replay", {k: v for k, v in state.items() if k != "positions"})):
            tokenized[0] = 0
            t0 = time.perf_counter()
            again = copy.copy(fresh)
            again.load_state_dict(saved)
            got = again.next_windows()
            out[f"{name}_s"] = round(time.perf_counter() - t0, 3)
            out[f"{name}_docs_tokenized"] = tokenized[0]
            assert all(np.array_equal(a, b) for wa, wb in zip(got, want) for a, b in zip(wa, wb)), name
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
