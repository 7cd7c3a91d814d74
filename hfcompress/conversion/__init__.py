"""The conversion: its configuration (validated whole before any work: config, options, preflight), the driver and its
steps in order (pipeline; run opens one conversion; calibrate; the methods' plans and fits through the method interface
and its registry; build; push), the streamed passes that onload one decoder layer at a time (passes, stream,
checkpoint), the steps that need a whole model (wholemodel: distillation, probe, speed), the per-layer plan
(layer_plan) and the output directory, written atomically (output, atomic). What the methods do lives in their own
packages (lisa, fasc, keys, distill); what the conversion proves lives in evidence."""
