set -x
cd /work/main
while ! grep -q "^trained" /work/data56/pipeline.log; do sleep 10; done
H=/work/data56/e3-ft3/head
.venv/bin/quickdraft train-head --method eagle3 --init-head $H --epochs 0 --num-prompts 0 --feature-layers 1 9 17 --dtype auto --max-seq-len 2048 --val-data /work/data56/specbench-val/data --out /work/data56/val-new
for RUN in sb-60 sb-60-run2; do
.venv/bin/quickdraft bench specbench --questions ../shared/data/specbench/questions.dev.jsonl --questions-per-task 10 --interleave --no-progress \
  --speculative-config '{"method": "eagle3", "label": "eagle3 session 55"}' \
  --speculative-config '{"method": "eagle3", "head": "'$H'", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.2, "label": "eagle3 new"}' \
  --out /work/data56/$RUN
echo benched $RUN
done
