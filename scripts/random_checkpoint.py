"""Write a random-weight Chatterbox checkpoint in the exact upstream file layout, made by upstream's own modules.

For machines without Hub access (the real ResembleAI/chatterbox weights cannot be downloaded there):
  t3_cfg.safetensors  full-size upstream T3 with seeded random weights (norms and biases randomised too)
  s3gen.safetensors   full-size upstream S3Gen (flow, CFM, HiFT, S3 tokenizer, CAM++), randomised the same way
  ve.safetensors      upstream's voice encoder, randomised
  tokenizer.json      a toy BPE tokenizer with upstream's special ids ([STOP]=0, [SPACE]=2, [START]=255)
  conds.pt            a random built-in voice saved by upstream's Conditionals.save
Needs the test environment (torch + chatterbox-tts): scripts/install_oracle.sh.
Usage: python scripts/random_checkpoint.py DST [--seed N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests/

from tests.reference import oracle  # noqa: E402
from tests.toy_tokenizer import write_toy_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dst", type=Path, help="folder to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # Written beside DST and renamed at the end, so that DST exists only when it is complete.
    tmp = args.dst.with_name(f".{args.dst.name}.writing-{os.getpid()}")
    try:
        oracle.write_t3_checkpoint(oracle.upstream_t3(oracle.FULL, seed=args.seed), tmp)
        oracle.write_s3gen_checkpoint(oracle.upstream_s3gen(seed=args.seed), tmp)
        oracle.write_ve_checkpoint(tmp, seed=args.seed)
        write_toy_tokenizer(tmp / "tokenizer.json")
        oracle.random_conds(oracle.FULL, seed=args.seed).save(tmp / "conds.pt")
        if args.dst.exists():
            shutil.rmtree(args.dst)
        os.replace(tmp, args.dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote a random-weight upstream checkpoint to {args.dst}")


if __name__ == "__main__":
    main()
