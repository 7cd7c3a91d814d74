"""What a conversion reads: the source model (a Hub id, a local directory, a GGUF file or the built-in SmolLM2; fetched,
checked and loaded by source), the Hub's network policy (hub: timeouts, transient failures, retries), the real English
texts for calibration and perplexity (text) and the token streams and windows cut from them before any model work
(token_streams)."""
