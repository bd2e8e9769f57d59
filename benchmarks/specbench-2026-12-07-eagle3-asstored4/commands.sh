set -x
cd /work/main
Q=".venv/bin/quickdraft train-head --method eagle3 --dtype auto --feature-layers 1 9 17 --epochs 0 --no-progress"
$Q --prompt-mix tasks --num-prompts 512 --seed 41 --out /work/data57/e3-t41
$Q --prompt-mix articles --num-prompts 1024 --seed 42 --extra-data /work/data57/e3-t41/data /work/data56/e3-t31/data /work/data55/e3-t21/data --max-seq-len 2048 --out /work/data57/e3-a42
echo generated
.venv/bin/quickdraft train-head --method eagle3 --dtype auto --init-head quickdraft/heads/gemma3-270m/eagle3 --num-prompts 0 --extra-data /work/data57/e3-t41/data /work/data57/e3-a42/data --feature-layers 1 9 17 --epochs 1 --learning-rate 0.0005 --max-seq-len 2048 --seed 44 --no-progress --val-data /work/data56/specbench-val/data --out /work/data57/e3-ft4
echo trained
set -x
cd /work/main
H=${1:-quickdraft/heads/gemma3-270m/eagle3}
OUT=${2:-/work/data57/dev-sweep}
.venv/bin/quickdraft bench specbench --questions /work/data55/dev/questions.dev-11-14.jsonl --questions-per-task 10 --interleave --no-progress \
  --speculative-config '{"method": "eagle3", "head": "'$H'", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.2, "label": "p0.2"}' \
  --speculative-config '{"method": "eagle3", "head": "'$H'", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.3, "label": "p0.3"}' \
  --speculative-config '{"method": "eagle3", "head": "'$H'", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.45, "label": "p0.45"}' \
  --speculative-config '{"method": "eagle3", "head": "'$H'", "num_speculative_tokens": 12, "top_k": 1, "min_draft_prob": 0.3, "label": "n12p0.3"}' \
  --out $OUT
echo swept
set -x
cd /work/main
H=/work/data57/e3-ft4/head
EXTRA=${1:-}
for RUN in sb-60 sb-60-run2; do
eval .venv/bin/quickdraft bench specbench --questions ../shared/data/specbench/questions.dev.jsonl --questions-per-task 10 --interleave --no-progress \
  --speculative-config "'"'{"method": "eagle3", "label": "eagle3 session 56"}'"'" \
  --speculative-config "'"'{"method": "eagle3", "head": "'$H'", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.2, "label": "eagle3 new"}'"'" \
  $EXTRA --out /work/data57/$RUN
echo benched $RUN
done
set -x
cd /work/main
.venv/bin/quickdraft bench specbench --questions ../shared/data/specbench/questions.dev.jsonl --questions-per-task 10 --interleave --no-progress \
  --speculative-config '{"method": "suffix", "label": "suffix"}' \
  --speculative-config '{"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.2}], "label": "hybrid"}' \
  --speculative-config '{"method": "eagle3", "label": "eagle3"}' \
  --out /work/data57/sb-60-hybrid
echo benched
