"""The values every layer passes: sequences, sampling parameters, prompts, outputs, the
scheduler's output, configuration, the incremental detokenizer a sequence carries, and the typed
errors a user can cause. The lowest layer: nothing here imports engine/, sample/, runner/ or
entrypoints/."""
