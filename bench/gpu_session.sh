#!/usr/bin/env bash
# One device call that measures the GPU runtime against llama.cpp in the same call (bench/gpu-notes.md): builds
# llama-bench and llama-batched-bench from the anchor tarball on cores 6-15 in the background, synthesizes the
# 48 x 256 full-width model on cores 0-3, runs the GPU tests on cores 4-5, then the prefill (bench_qmm.py), the
# batched decode (bench_gpu_batch.py) and the batch-1 rows (bench_gpu_run.py), then llama-bench and
# llama-batched-bench on the same GGUF once the build is done.
#
# Usage (on the GPU machine, from the repository root; carried folders: WHL wheels, KIT the kit with its README.md,
# ANCHORS a copy of ../shared/anchors):
#   OUT=/tmp/out WHL=.whl KIT=.kitgpu ANCHORS=.anchors bash bench/gpu_session.sh [ROWS] [TESTS]
# ROWS: bench_gpu_run.py --configs (default resident,nopdl,vram12; "none" skips the rows)
# TESTS: pytest arguments, quotes honoured (default the GPU decoder, prefill, GEMM and batch tests; "none" skips them)
# PV: bench_qmm.py --prefill-variants (default mma; "none" skips the prefill); BN: bench_gpu_batch.py --n (default
# 1,8,32; "none" skips it); BV: its --variants (default default); BO=1 times them again in the reverse order;
# B1S: its --b1-steps (a longer batch-1 window, e.g. 64; default 0: none);
# E2E=1 adds its end-to-end run_batched row;
# LLAMA=0 skips the llama.cpp build and its benches;
# TYPES2 (e.g. gu=IQ2_XS,down=IQ4_NL): a second model of those expert types, measured by the resident batch-1 row
# (after the first model's rows, while llama.cpp builds) and at the end by llama-bench (run2.txt / .json,
# llama-bench2.md); PV2: prefill variants measured again after the llama.cpp benches (qmm2.txt / .json), when the
# build no longer slows them; NPL: llama-batched-bench's -npl (default 1,8,32). PRE: shell commands run after the tests,
# while the model is synthesized (e.g. bench/bench_qmm_jobs.py, which needs no model); POST: after the batched bench
# (the model's path in $GG).
# Every result lands in $OUT (tests.txt, synth.json, qmm.txt / .json, batch.txt / .json, run.txt / .json,
# llama-bench.md, llama-batched.txt, build logs). The call's output keeps only its last 12,000 characters: read $OUT.
set -u
ROWS=${1:-resident,nopdl,vram12}
TESTS=${2:-tests/test_gpu_prefill.py tests/test_gpu_qmm.py tests/test_gpu_batch.py tests/test_gpu_run.py tests/test_gpu_decode.py}
: "${OUT:?set OUT to the folder that comes back}"
WHL=${WHL:-.whl} KIT=${KIT:-.kitgpu} ANCHORS=${ANCHORS:-.anchors} TYPES=${TYPES:-gu=Q2_0,down=Q2_0}
PV=${PV:-mma} BN=${BN:-1,8,32} BV=${BV:-default} LLAMA=${LLAMA:-1}
mkdir -p "$OUT" /tmp/lc /tmp/fw
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 STRATATOOLS_KIT=$PWD/$KIT
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
rm -f /tmp/lcb.done /tmp/synth.done /tmp/synth2.done
[ "$LLAMA" = 0 ] || ( tar -xzf "$ANCHORS"/llama.cpp-*-src.tar.gz -C /tmp/lc && cd /tmp/lc/llama.cpp \
  && taskset -c 6-15 cmake -S . -B /tmp/lcb -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
       -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
       -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > "$OUT"/llama-cmake.log 2>&1 \
  && taskset -c 6-15 nice ninja -C /tmp/lcb -j10 llama-bench llama-batched-bench > "$OUT"/llama-build.log 2>&1
  echo "build rc=$?" > /tmp/lcb.done ) &
( taskset -c 0-3 python3 -m stratatools synth /tmp/fw/model48x256 --full-width --no-revisions --layers 48 \
    --experts 256 --types "$TYPES" --force --json > "$OUT"/synth.json 2> "$OUT"/synth.err; echo done > /tmp/synth.done
  if [ -n "${TYPES2:-}" ]; then
    taskset -c 0-3 python3 -m stratatools synth /tmp/fw2/model48x256 --full-width --no-revisions --layers 48 \
      --experts 256 --types "$TYPES2" --force --json > "$OUT"/synth2.json 2> "$OUT"/synth2.err
  fi; echo done > /tmp/synth2.done ) &
if [ "$TESTS" != none ]; then
  el tests
  # (eval: TESTS may quote a -k expression, e.g. "tests/test_gpu_qmm.py -k 'split or jobs'")
  eval "taskset -c 4-5 timeout 300 python3 -m pytest -rf -p no:cacheprovider $TESTS" > "$OUT"/tests.txt 2>&1
  echo "tests rc=$?"; grep -E "^FAILED|^E  .{0,100}|[0-9]+ (passed|failed)" "$OUT"/tests.txt | cut -c1-200 | tail -24
fi
if [ -n "${PRE:-}" ]; then el pre; eval "$PRE"; fi  # PRE: commands run while the model is synthesized
el wait synth; while [ ! -f /tmp/synth.done ]; do sleep 2; done
GG=$(find /tmp/fw/model48x256 -name "*.gguf" | sort | head -1); echo "model: $GG"
if [ "$PV" != none ]; then
  el prefill
  timeout 240 python3 bench/bench_qmm.py --gguf "$GG" --layers 48 --prompt 512 --skip dense,experts \
    --prefill-variants "$PV" --prefill-reps 4 --kernel-profile --out "$OUT"/qmm.json > "$OUT"/qmm.txt 2>&1
  grep -E "^prefill" "$OUT"/qmm.txt
fi
if [ "$BN" != none ]; then
  el batched
  timeout $([ "${BO:-0}" = 1 ] && echo 360 || echo 200) python3 bench/bench_gpu_batch.py --gguf "$GG" --layers 48 \
    --n "$BN" --steps 8 --b1-steps "${B1S:-0}" $([ "${E2E:-0}" = 1 ] || echo --no-e2e) \
    --variants "$BV" $([ "${BO:-0}" = 1 ] && echo --both-orders) --kernel-profile 2 --out "$OUT"/batch.json \
    > "$OUT"/batch.txt 2>&1
  grep -E "tok/s" "$OUT"/batch.txt
fi
if [ -n "${POST:-}" ]; then el post; eval "$POST"; fi  # POST: commands run after the batched bench ($GG: the model)
if [ "$ROWS" != none ]; then
  el run rows
  timeout 240 python3 bench/bench_gpu_run.py --gguf "$GG" --workdir /tmp/fw --prompt 512 --new 64 --slots 1872 \
    --types "$TYPES" --configs "$ROWS" --compare-steps 0 --profile-steps 0 --out "$OUT"/run.json > "$OUT"/run.txt 2>&1
  grep -E "decode [0-9]" "$OUT"/run.txt | head -20
fi
second() {  # the TYPES2 model's resident batch-1 row, run while llama.cpp builds
  [ -n "${TYPES2:-}" ] || return 0
  el second model; while [ ! -f /tmp/synth2.done ]; do sleep 2; done
  G2=$(find /tmp/fw2/model48x256 -name "*.gguf" | sort | head -1); echo "model 2: $G2"
  timeout 150 python3 bench/bench_gpu_run.py --gguf "$G2" --workdir /tmp/fw2 --prompt 512 --new 64 --slots 1872 \
    --types "$TYPES2" --configs resident --compare-steps 0 --profile-steps 0 --out "$OUT"/run2.json > "$OUT"/run2.txt 2>&1
  grep -E "decode [0-9]|prefill" "$OUT"/run2.txt | head -6
}
second_llama() {  # llama-bench on the TYPES2 model, once built
  [ -n "${G2:-}" ] || return 0  # (second() sets G2 where TYPES2 is set)
  el llama-bench model 2
  timeout 100 /tmp/lcb/bin/llama-bench -m "$G2" -ngl 99 -p 512 -n 128 -r 3 -o md 2> "$OUT"/llama-bench2.err \
    | tee "$OUT"/llama-bench2.md
}
second
if [ "$LLAMA" = 0 ]; then el done; exit 0; fi
el wait build; while [ ! -f /tmp/lcb.done ]; do sleep 3; done; cat /tmp/lcb.done
el llama-bench
timeout 100 /tmp/lcb/bin/llama-bench -m "$GG" -ngl 99 -p 512 -n 128 -r 3 -o md 2> "$OUT"/llama-bench.err \
  | tee "$OUT"/llama-bench.md
el llama-batched-bench
timeout 120 /tmp/lcb/bin/llama-batched-bench -m "$GG" -ngl 99 -c 16384 -b 2048 -ub 512 -npp 128 -ntg 128 \
  -npl "${NPL:-1,8,32}" > "$OUT"/llama-batched.txt 2>&1
grep -E "^\|" "$OUT"/llama-batched.txt | tail -5
if [ -n "${PV2:-}" ]; then  # the prefill again, now that the build no longer shares the machine
  el prefill after the build
  timeout 150 python3 bench/bench_qmm.py --gguf "$GG" --layers 48 --prompt 512 --skip dense,experts \
    --prefill-variants "$PV2" --prefill-reps 4 --out "$OUT"/qmm2.json > "$OUT"/qmm2.txt 2>&1
  grep -E "^prefill" "$OUT"/qmm2.txt
fi
second_llama
el done
