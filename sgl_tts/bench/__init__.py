"""The goodput benchmark (issue 7): stock SGLang vs SGLang with sgl-tts, side by side."""
