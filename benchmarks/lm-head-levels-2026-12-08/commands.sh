# Session 59 (2026-12-08), 2-core AMD EPYC Zen 3 VM (AVX2), embedded Gemma 3 270M (GGUF Q4_K_M as stored).
# run1.json, run2.json: LM head, forward curve, Spec-Bench first turns (5 per category, 65 prompts), precision
cd benchmarks && python lm_head_levels.py --per-category 5 --rounds 3 --widths 1 2 4 8 16 32 --skip agreement --json lm-head-levels-2026-12-08/run1.json
cd benchmarks && python lm_head_levels.py --per-category 5 --rounds 3 --widths 1 2 4 8 16 32 --skip agreement --json lm-head-levels-2026-12-08/run2.json
# float32-agreement.json: each arm's plain answers against dtype="float32"
cd benchmarks && python lm_head_levels.py --per-category 5 --skip kernel curve e2e --json lm-head-levels-2026-12-08/float32-agreement.json
