#!/usr/bin/env bash
# The study of docs/results.md, on the Qwen2.5-Coder 1.5B / 0.5B pair, with the project's own commands.
# Sized for a 2-core, 24 GB CPU machine, 32 new tokens: the main table 2 prompts per dataset (a standard error
# needs two), the drafts x block ablation 1 MT-Bench prompt, the temperature ablation 1 HumanEval prompt, exactness
# float32 with 2 MT-Bench prompts of 24 tokens. One job at a time: two float32 jobs do not fit in 24 GB together, and
# the speedups need a quiet machine. Rerunning a part resumes it (every job skips the prompts already recorded in its
# folder; a larger limit adds prompts).
# Usage: bash sweeps/study.sh [main|ablation|temperature|exactness]...   (default: all four)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
COMMON="logger=none limit=1 max_new_tokens=32"

main() {  # Table 1: block length 8, temperature 0.4, the five datasets, speedup over ar measured in each job
  local MAIN="logger=none limit=2 max_new_tokens=32 block_length=8 temperature=0.4 dataset=all baseline=true"
  $PY run.py -m verifier=token,bv,gbv num_drafts=1 $MAIN hydra.sweep.dir=docs/runs/main/k1
  $PY run.py -m verifier=spectr,specinfer,multipath,gbv,spectr_gbv_paper num_drafts=3 $MAIN \
    hydra.sweep.dir=docs/runs/main/k3
}

ablation() {  # num_drafts x block_length for gbv and spectr, on MT-Bench (HumanEval's first prompt accepts every
  # draft at every K and L: block efficiency 2.91 / 4.57 / 8.00 for L = 2 / 4 / 8 whatever K, so it shows nothing)
  $PY run.py -m verifier=gbv num_drafts=1,2,3,4 block_length=2,4,8 temperature=0.4 dataset=mtbench $COMMON \
    hydra.sweep.dir=docs/runs/ablation/gbv
  $PY run.py -m verifier=spectr num_drafts=1,2,3,4 block_length=2,4,8 temperature=0.4 dataset=mtbench $COMMON \
    hydra.sweep.dir=docs/runs/ablation/spectr
}

temperature() {  # gbv, K=3, L=8 at temperature 0 (drafts at 0.4, or all K drafts would be equal), 0.4 and 1.0
  $PY run.py verifier=gbv num_drafts=3 block_length=8 temperature=0 draft_temperature=0.4 dataset=humaneval \
    $COMMON hydra.run.dir=docs/runs/temperature/t0
  $PY run.py -m verifier=gbv num_drafts=3 block_length=8 temperature=0.4,1.0 dataset=humaneval $COMMON \
    hydra.sweep.dir=docs/runs/temperature/t
}

exactness() {  # temperature 0, float32: every lossless verifier must emit ar's tokens on the same prompts
  F32="model.dtype=float32 drafter.dtype=float32 temperature=0 dataset=mtbench logger=none limit=2 max_new_tokens=24"
  $PY run.py -m verifier=ar,token,bv,gbv num_drafts=1 block_length=4 $F32 hydra.sweep.dir=docs/runs/exactness/k1
  $PY run.py -m verifier=gbv,spectr,specinfer,nss,multipath,spectr_gbv_paper num_drafts=3 block_length=4 \
    draft_temperature=1.0 $F32 hydra.sweep.dir=docs/runs/exactness/k3
}

for part in "${@:-main ablation temperature exactness}"; do
  for p in $part; do "$p"; done
done
