"""What proves a conversion: held-out perplexity and the reload check (validate) and the quality gate over it (gate), the
factual probe (probe), the training-free peers a user could pick instead (peers), side-by-side speed (speed), the typed
report every consumer reads (report), the model card and its plots (card, plots), and the commands that produce
evidence without converting: `hfcompress eval` (evaluate, with lm-eval through harness) and `hfcompress analyze`."""
