"""Request examples of MindIE's pages (../shared/spec), verbatim."""

# triton_generate.zh.txt
GENERATE = {
    "id": "a123",
    "text_input": "My name is Olivier and I",
    "parameters": {
        "details": True,
        "do_sample": True,
        "max_new_tokens": 250,
        "repetition_penalty": 1.1,
        "seed": 123,
        "temperature": 1,
        "top_k": 10,
        "top_p": 0.99,
        "batch_size": 100,
        "typical_p": 0.5,
        "watermark": False,
        "perf_stat": False,
    },
}
