# Session 58 (2026-12-07), the 2-core AMD EPYC Zen 3 VM; embedded Gemma 3 270M, GGUF Q4_K_M as stored.
# multi-turn-before-fix/: on ed9fab9 (before the prefix-cache fix, fe99e57); the rest after it.
.venv/bin/quickdraft bench specbench --questions ../shared/data/specbench/questions.dev.jsonl --categories multi-turn --questions-per-task 10 --interleave --no-progress \
  --speculative-config '{"method": "suffix", "label": "suffix"}' \
  --speculative-config '{"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.2}], "label": "hybrid"}' \
  --out multi-turn-before-fix
# multi-turn-after-fix/: the same with '{"method": "eagle3", "label": "eagle3"}' added
for RUN in run1 run2; do
.venv/bin/quickdraft bench specbench --questions ../shared/data/specbench/questions.dev.jsonl --questions-per-task 10 --interleave --no-progress \
  --speculative-config '{"method": "suffix", "label": "suffix"}' \
  --speculative-config '{"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.2}], "label": "hybrid"}' \
  --speculative-config '{"method": "eagle3", "label": "eagle3"}' \
  --out $RUN
done
# hybrid-settings-run1/, hybrid-settings-run2/: the README demo's hybrid and skip_after 1 beside suffix
for RUN in hybrid-settings-run1 hybrid-settings-run2; do
.venv/bin/quickdraft bench specbench --questions ../shared/data/specbench/questions.dev.jsonl --questions-per-task 10 --interleave --no-progress \
  --speculative-config '{"method": "suffix", "label": "suffix"}' \
  --speculative-config '{"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3", "top_k": 1, "head_dtype": "bfloat16", "min_draft_prob": 0.2}], "skip_after": 2, "max_draft_tokens": 12, "label": "hybrid demo"}' \
  --speculative-config '{"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3", "num_speculative_tokens": 8, "top_k": 1, "min_draft_prob": 0.2}], "skip_after": 1, "label": "hybrid skip 1"}' \
  --out $RUN
done
