"""Front end: tokenize, validate, fan out n > 1, detokenize, stop strings, outputs."""
