#!/usr/bin/env bash
# Device call after scripts/device/stage.sh: issue 21's preference distillation at the scale the
# CPU cannot reach (scripts/device/README.md, "Distillation"). Three steps, each skipped once its
# output is complete, so repeated calls on the same machine continue where the last one
# stopped:
#   1. the teacher's preference set (`distill --score-only`; resumable question by question);
#   2. the adapter (`distill` on the finished set; not resumable, so it starts only with at
#      least TRAIN_MIN seconds of the call left, and a cut run starts over next call);
#   3. `distill-eval` on development questions (resumable; the distilled student is added to
#      the teacher's and the raw student's records).
# Every call ends by packing the folder into $OUT/distill.tgz with the log: unpack it into
# results/eval/distill/ here. A machine lost between calls starts from SEED (a folder holding
# an earlier distill.tgz's contents, carried with the call).
#
# LR overrides the CLI's learning rate (the paper's 1e-4 is for thousands of steps).
# SCORE_FOR=S caps step 1 at S seconds for a session with little device time: the questions
# scored by then (a prefix, give or take the CONCURRENCY in flight) become the set, LIMIT is cut
# to their count (kept in $WORK/.limit for later calls) and training starts in the same call.
#
# LOCAL=1 rehearses the same steps here on the CPU with .venv (tiny LIMIT/K/DEV_LIMIT), so a
# GPU call is not where a mistake in the arguments is found.
set -uo pipefail
started=$SECONDS
if [[ ${LOCAL:-0} == 1 ]]; then
    read -ra rr <<<"${RR:-.venv/bin/rag-reorder}"
    OUT=${OUT:-/tmp/distill-out}
    mkdir -p "$OUT"
else
    source scripts/device/env.sh
    rr=(python3 -m entrypoints)
fi
BUDGET=${BUDGET:-540}   # seconds of this call for the steps; the packing follows
DATA=${DATA:-/tmp/data}
WORK=${WORK:-/tmp/distill}
TEACHER=${TEACHER:-google/gemma-3-270m}
STUDENT=${STUDENT:-HuggingFaceTB/SmolLM2-135M-Instruct}
LIMIT=${LIMIT:-1000} N=${N:-5} K=${K:-30} EPOCHS=${EPOCHS:-5} HELD_BACK=${HELD_BACK:-10}
DEV_LIMIT=${DEV_LIMIT:-200} CONCURRENCY=${CONCURRENCY:-16} TRAIN_MIN=${TRAIN_MIN:-300}
# distill-eval's seconds per question include waiting above 1; its prompt tokens do not.
DEV_CONCURRENCY=${DEV_CONCURRENCY:-8}
log=$OUT/distill-log.txt

failed=0  # a step's exit status other than 0 and timeout's 124 (cut by BUDGET: continued next call)
left() { echo $((BUDGET - (SECONDS - started))); }
say() { echo "[$((SECONDS - started)) s] $*" | tee -a "$log"; }
# One step: the CLI with ARGS for the rest of the call's budget, output into the log; sets rc
# (and failed, unless the step succeeded or was cut by the budget) and returns rc.
step() {
    local t
    t=$(left)
    ((${cap:-0} > 0 && cap < t)) && t=$cap
    timeout "$t" "${rr[@]}" "$@" >>"$log" 2>&1
    rc=$?
    ((rc == 0 || rc == 124)) || failed=$rc
    return "$rc"
}

if [[ ! -d $WORK && -n ${SEED:-} ]]; then
    cp -r "$SEED" "$WORK"
    say "seeded $WORK from $SEED"
fi
mkdir -p "$WORK"
[[ -f $WORK/.limit ]] && LIMIT=$(cat "$WORK/.limit")
# --limit is given per step: SCORE_FOR may cut LIMIT after step 1.
common=(--data "$DATA/nq_open_train.jsonl" --teacher "$TEACHER"
    --student "$STUDENT" --passages "$N" --permutations "$K" --concurrency "$CONCURRENCY"
    --no-progress --out "$WORK")

# A step that exits 0 is complete (a marker file); one cut by BUDGET continues next call.
scored() { cat "$WORK/preferences.jsonl" 2>/dev/null | grep -c '^{"id"'; }
if [[ ! -f $WORK/.scored ]]; then
    say "1. preference set: $(scored)/$LIMIT questions scored"
    cap=${SCORE_FOR:-0} step distill "${common[@]}" --limit "$LIMIT" --score-only &&
        touch "$WORK/.scored"
    say "1. preference set: $(scored)/$LIMIT (rc=$rc)"
    if [[ ! -f $WORK/.scored && $rc == 124 && -n ${SCORE_FOR:-} ]] && (($(scored) > HELD_BACK)); then
        LIMIT=$(scored)
        echo "$LIMIT" >"$WORK/.limit"
        touch "$WORK/.scored"
        say "1. SCORE_FOR=$SCORE_FOR s reached: the set is the first $LIMIT questions"
    fi
fi
if [[ -f $WORK/.scored && ! -f $WORK/distill.json ]]; then
    if (($(left) >= TRAIN_MIN)); then
        say "2. training, $EPOCHS epochs"
        step distill "${common[@]}" --limit "$LIMIT" --epochs "$EPOCHS" --held-back "$HELD_BACK" \
            ${LR:+--lr "$LR"}
        say "2. training: rc=$rc ($([[ -f $WORK/distill.json ]] && echo done || echo not done))"
    else
        say "2. training waits for a call with $TRAIN_MIN s left ($(left) s now)"
    fi
fi
if [[ -f $WORK/distill.json && ! -f $WORK/.evaluated ]] && (($(left) > 30)); then
    say "3. distill-eval on $DEV_LIMIT development questions"
    step distill-eval --data "$DATA/nq_open_dev.jsonl" --limit "$DEV_LIMIT" \
        --teacher "$TEACHER" --student "$STUDENT" --adapter "$WORK" --passages "$N" \
        --concurrency "$DEV_CONCURRENCY" --no-progress --out "$WORK/dev" &&
        touch "$WORK/.evaluated"
    say "3. distill-eval: rc=$rc"
fi
[[ -f $WORK/distill.json ]] && cat "$WORK/distill.json" >>"$log"
tar czf "$OUT/distill.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")"
say "packed $OUT/distill.tgz"
exit "$failed"
