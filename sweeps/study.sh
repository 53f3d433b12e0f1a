#!/usr/bin/env bash
# The study of docs/results.md on the Qwen2.5-Coder 1.5B / 0.5B pair (bfloat16), with the project's own commands.
# Every part writes below docs/study/<part>/ and resumes: a job skips the prompts already recorded in its folder, and a
# larger LIMIT adds prompts to every job of a part (so a part can grow in passes: LIMIT=4, then 8, ... 20, each pass
# leaving every method with the same prompts). One part at a time: the speed part needs a quiet machine.
# Usage: [LIMIT=N] bash sweeps/study.sh [main|ablation|temperature|speed|audit|arena]...   (default: all six)
set -euo pipefail -f  # -f: no globbing, the overrides hold brackets
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=${RUN:-run.py}
OUT=${OUT:-docs/study}
LIMIT=${LIMIT:-20}
PAIR="model.dtype=bfloat16 drafter.dtype=bfloat16"  # the study's precision, not what dtype auto picks on this machine
names() { $PY -c "from spectr_gbv.verifiers import verifier_names; print(','.join(verifier_names($1)))"; }
K1="$(names multi_draft=False),gbv"  # the registry's single-draft verifiers (token, bv), and gbv at K = 1
K3=$(names multi_draft=True)         # the registry's multi-draft ones at K = 3, gbv first
# The main part's K = 3 jobs in the order docs/study/main/k3 numbered its folders (a job's folder is its place in the
# list, and a resumed job must find its own records there): the registry's multi-draft verifiers, gbv moved, traversal
# (added later) last.
K3_MAIN="spectr,specinfer,nss,multipath,gbv,spectr_gbv_paper,traversal"

main() {  # the paper's Table 1 shape: L = 8, T = 0.4, the five datasets, 20 prompts each, 128 new tokens
  local MAIN="dataset=all limit=$LIMIT max_new_tokens=128 block_length=8 temperature=0.4 batch_size=8 logger=none"
  MAIN="$MAIN $PAIR"
  $PY $RUN -m verifier=$K1 num_drafts=1 $MAIN hydra.sweep.dir=$OUT/main/k1
  $PY $RUN -m verifier=$K3_MAIN num_drafts=3 $MAIN hydra.sweep.dir=$OUT/main/k3
}

ablation() {  # num_drafts x block_length for gbv and spectr, MT-Bench and HumanEval, 20 prompts each, 64 new tokens
  local ABL="dataset=[mtbench,humaneval] limit=$LIMIT max_new_tokens=64 temperature=0.4 $PAIR"
  for verifier in gbv spectr; do
    $PY $RUN -m verifier=$verifier num_drafts=1,2,3,4 block_length=2,4,8 $ABL batch_size=8 logger=none \
      hydra.sweep.dir=$OUT/ablation/$verifier
  done
}

temperature() {  # gbv and spectr at K = 3, L = 8 on the ablation's 40 prompts; at T = 0 the drafts sample at 0.4
  local TEMP="dataset=[mtbench,humaneval] limit=$LIMIT max_new_tokens=64 num_drafts=3"
  TEMP="$TEMP block_length=8 batch_size=8 logger=none $PAIR"
  $PY $RUN -m verifier=gbv,spectr temperature=0 draft_temperature=0.4 $TEMP hydra.sweep.dir=$OUT/temperature/t0
  $PY $RUN -m verifier=gbv,spectr temperature=0.4,0.7,1.0 $TEMP hydra.sweep.dir=$OUT/temperature/t
}

speed() {  # batch size 1, each prompt also decoded by ar (baseline=true): L = SPEED_L (4; 8 writes speed/l8), T = 0.4,
           # SPEED_LIMIT (2) prompts per dataset; each summary holds its machine and the cost-model limit of its speedup
           # (bare passes timed after decoding); a job resumed on another machine says "mixed: ..." there: on a new
           # machine, delete its folder and rerun. SPEED_PAIR (default the study's PAIR) names the precision: speed is
           # the machine's, so where bfloat16 is emulated give the precision dtype auto picks there (docs/performance.md)
  local L=${SPEED_L:-4} DIR=$OUT/speed
  [ "$L" = 4 ] || DIR=$OUT/speed/l$L
  local SPEED="dataset=all limit=${SPEED_LIMIT:-2} max_new_tokens=128 block_length=$L temperature=0.4 batch_size=1"
  SPEED="$SPEED baseline=true ${SPEED_PAIR:-$PAIR}"
  $PY $RUN -m verifier=$K1 num_drafts=1 $SPEED logger=none hydra.sweep.dir=$DIR/k1
  # gbv first: a pass cut short still times the project's own K = 3 rule
  $PY $RUN -m verifier=$K3 num_drafts=3 $SPEED logger=none hydra.sweep.dir=$DIR/k3
}

audit() {  # exact audit on distributions of the real pair: 20 contexts, top-6 tokens, depth 2, K = 1, 2, 3
  mkdir -p $OUT/audit
  $PY -m spectr_gbv.tools.audit --real --json $OUT/audit/real.json
}

arena() {  # every verifier on the drafts of gbv's own decodes (mode=arena), scored with the state gbv carries: decodes at
           # K = ARENA_K (1 and 4) x L = 4, 8 x T = 0.4, 1.0, the five datasets, LIMIT prompts each. A decode at K scores
           # every stateless rule at every k <= K and gbv at K (carried and fresh). Then bv's own decode at L=4 T=1.0
           # (ARENA_BV=0 skips it): its contexts against gbv's, for rules the decode's path could favour.
  local ARENA="mode=arena dataset=all limit=$LIMIT max_new_tokens=${ARENA_TOKENS:-128} batch_size=8"
  ARENA="$ARENA replicas=${REPLICAS:-8} logger=none $PAIR"
  for k in ${ARENA_K:-1 4}; do
    $PY $RUN -m $ARENA verifier=gbv num_drafts=$k block_length=4,8 temperature=0.4,1.0 hydra.sweep.dir=$OUT/arena/k$k
  done
  if [ "${ARENA_BV:-1}" = 1 ]; then
    $PY $RUN -m $ARENA verifier=bv num_drafts=1 block_length=4 temperature=1.0 "verifiers=[bv]" \
      hydra.sweep.dir=$OUT/arena/bv
  fi
}

for part in ${@:-main ablation temperature speed audit arena}; do
  "$part"
done
