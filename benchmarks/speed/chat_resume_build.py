"""Time to build the training data of a conversation run (``data.kind chat``) on its first start, which reads and
renders the whole set, and on a resume on the same files, which uses the first start's summary, on the CPU.

    python benchmarks/speed/chat_resume_build.py [--traces 2000] [--buffer 100] [--out FILE.json]

The agent-trace recipe's tokenizer and generated traces (``recipes/agent-traces-tiny/make_checkpoint.py``) are
written to a temporary directory, the traces repeated to ``--traces`` conversations. A first start builds the
data and reads one step; a resume from its state builds the data again and reads the next step, which must be
the first start's next step (checked). The JSON gives the seconds and the conversations rendered of each build,
and of the resume's first step.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import numpy as np

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "agent-traces-tiny"


def write_set(root: Path, traces: int) -> tuple[Path, Path]:
    """(the tokenizer directory, a JSONL of ``traces`` conversations)."""
    spec = importlib.util.spec_from_file_location("make_checkpoint", RECIPE / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ckpt = module.main(root)
    lines = (root / "traces.jsonl").read_text().splitlines(keepends=True)
    (root / "many.jsonl").write_text("".join(lines[i % len(lines)] for i in range(traces)))
    return ckpt, root / "many.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=2_000)
    ap.add_argument("--buffer", type=int, default=100, help="data.shuffle_buffer")
    ap.add_argument("--seq-len", type=int, default=1023)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from megaseq.config import DataConfig
    from megaseq.data import build_data
    from megaseq.data.chat import ChatRenderer

    rendered = [0]
    real = ChatRenderer.render

    def counted(self, *a, **kw):
        rendered[0] += 1
        return real(self, *a, **kw)

    ChatRenderer.render = counted
    out: dict = {"traces": args.traces, "shuffle_buffer": args.buffer, "seq_len": args.seq_len}
    with tempfile.TemporaryDirectory() as tmp:
        tok, train = write_set(Path(tmp), args.traces)
        cfg = DataConfig(kind="chat", tokenizer=str(tok), train=[str(train)], seq_len=args.seq_len,
                         shuffle_buffer=args.buffer, heldout=[])
        state, want = None, None
        for name in ("first_start", "resume"):
            rendered[0] = 0
            t0 = time.perf_counter()
            data = build_data(cfg, batch_size=4, resume_state=state)
            out[f"{name}_build_s"] = round(time.perf_counter() - t0, 3)
            out[f"{name}_build_rendered"] = rendered[0]
            if state is None:
                data.train.next_windows()
                state = json.loads(json.dumps(data.train.state_dict()))
                want = copy.copy(data.train).next_windows()
                continue
            out["resume_log"] = data.log
            data.train.load_state_dict(state)
            rendered[0] = 0
            t0 = time.perf_counter()
            got = data.train.next_windows()
            out["resume_first_step_s"] = round(time.perf_counter() - t0, 3)
            out["resume_first_step_rendered"] = rendered[0]
            assert all(np.array_equal(a, b) for wa, wb in zip(got, want) for a, b in zip(wa, wb))
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
