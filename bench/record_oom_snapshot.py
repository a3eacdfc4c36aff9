"""Record a real out-of-memory snapshot of this project's trainer for the triage's fixtures (GPU; issue 46).

Runs the README's one-GPU slice through the driver with the settings that run out of memory on an 80 GB GPU (the
shipped ``LM_HEAD_LOSS_CHUNK_SIZE=0``: the 37.09 GiB logits) and ``FIT_CHECK=warn`` (the fit check would refuse it),
one kernel and one memory trial of step 1, ``STOP_ON_FAILURE=0``; on a GPU with more memory, more tokens
(``--tokens``) make it run out. Then copies each trial's
``memory_snapshots/oom/`` (snapshot + ``oom_rank0.json``), gzipped, with its ``config.yaml``, ``environment.json`` and
``stats.jsonl``, into ``--out`` (e.g. ``tests/fixtures/h100_oom/``), and prints the failed trials' first finding.

    python bench/record_oom_snapshot.py --out tests/fixtures/h100_oom          # an H100 80 GB: ~4 min
    python bench/record_oom_snapshot.py --out /tmp/oom --tokens 262144         # an H200: twice the tokens

Expected on an H100 80 GB: both trials fail at step 0 or 1 with ``Tried to allocate 37.09 GiB``; each summary's first
finding names the LM head's logits (``megatron/core/tensor_parallel/layers.py``, the LM head backward or forward)
and proposes ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True LM_HEAD_LOSS_CHUNK_SIZE=2048``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the recorded fixture (created)")
    p.add_argument("--work", default="/tmp/sftprof_oom_record", help="RUN_ROOT and FILEROOT go here")
    p.add_argument("--tokens", type=int, default=131072)
    args = p.parse_args()
    work, out = Path(args.work), Path(args.out)
    env = {**os.environ, "N_GPUS_PER_NODE": "1", "TRAIN_BATCH_SIZE": "1", "PROFILE_N_MBS": "1", "PROFILE_STEPS": "1",
           "TOTAL_STEPS": "2", "STOP_ON_FAILURE": "0", "FIT_CHECK": "warn", "PROFILE_FAKE_SEQ_LEN": str(args.tokens),
           "RUN_ROOT": str(work / "run"), "FILEROOT": str(work / "fileroot"), "PROFILE_STAMP": "oom"}
    subprocess.run(["bash", str(ROOT / "run_qwen3_30b_a3b_sft_profile.sh"), "actor.backend=megatron:d1",
                    "actor.num_layers=4"], env=env)  # its trials are expected to fail
    for summary_path in sorted((work / "run").glob("*/profile_summary.json")):
        summary = json.loads(summary_path.read_text())
        log_dir = Path(summary["paths"]["log_dir"])
        oom = log_dir / "memory_snapshots" / "oom"
        if not oom.is_dir():
            print(f"{summary['trial']}: status {summary['status']}, no out-of-memory snapshot")
            continue
        dest = out / summary["profile_kind"]
        (dest / "memory_snapshots" / "oom").mkdir(parents=True, exist_ok=True)
        for f in oom.iterdir():
            target = dest / "memory_snapshots" / "oom" / f.name
            if f.suffix == ".pickle":
                with open(f, "rb") as src, gzip.open(str(target) + ".gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
            else:
                shutil.copy(f, target)
        for name in ("config.yaml", "environment.json", "stats.jsonl"):
            if (log_dir / name).exists():
                shutil.copy(log_dir / name, dest / name)
        print(f"{summary['trial']}: {summary['findings'][0]['text'] if summary['findings'] else 'no finding'}")


if __name__ == "__main__":
    main()
