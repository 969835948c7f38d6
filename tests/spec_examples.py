"""The request examples of MindIE's pages (../shared/spec), verbatim, with the model of their URL."""

# infer_token.en.txt and infer_token.example.zh.txt: POST /infer_token
INFER_TOKEN = {
    "input_id": [5618, 19678, 701, 9072, 13],
    "stream": False,
    "parameters": {
        "temperature": 0.5,
        "top_k": 10,
        "top_p": 0.95,
        "max_new_tokens": 20,
        "do_sample": True,
        "seed": None,
        "repetition_penalty": 1.03,
        "details": True,
        "typical_p": 0.5,
        "watermark": False,
        "priority": 5,
        "timeout": 10,
    },
}

# triton_generate.zh.txt: POST /v2/models/llama_65b/generate
GENERATE_MODEL = "llama_65b"
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

# triton_generate_stream.en.txt: POST /v2/models/llama3-70b/generate_stream
GENERATE_STREAM_MODEL = "llama3-70b"
GENERATE_STREAM = {
    "id": "a123",
    "text_input": "My name is Olivier and I",
    "parameters": {
        "details": True,
        "do_sample": True,
        "max_new_tokens": 5,
        "repetition_penalty": 1.1,
        "seed": 123,
        "temperature": 1,
        "top_k": 10,
        "top_p": 0.99,
        "batch_size": 100,
        "typical_p": 0.5,
        "watermark": False,
        "priority": 5,
        "timeout": 10,
    },
}
GENERATE_STREAM_MULTIMODAL = {
    "id": "a123",
    "text_input": [
        {"type": "text", "text": "My name is Olivier and I"},
        {"type": "image_url", "image_url": "/xxxx/test.png"},
    ],
    "parameters": {
        "details": True,
        "do_sample": True,
        "max_new_tokens": 20,
        "repetition_penalty": 1.1,
        "seed": 123,
        "temperature": 1,
        "top_k": 10,
        "top_p": 0.99,
        "batch_size": 100,
        "typical_p": 0.5,
        "watermark": False,
        "priority": 5,
        "timeout": 10,
    },
}

# triton_infer_token.zh.md: POST /v2/models/llama3-70b/infer
TRITON_INFER_MODEL = "llama3-70b"
TRITON_INFER = {
    "id": "42",
    "inputs": [
        {
            "name": "input0",
            "shape": [1, 10],
            "datatype": "UINT32",
            "data": [396, 319, 13996, 29877, 29901, 29907, 3333, 20718, 316, 23924],
        }
    ],
    "outputs": [{"name": "output0"}],
    "parameters": {
        "temperature": 0.5,
        "top_k": 10,
        "top_p": 0.95,
        "do_sample": True,
        "seed": None,
        "repetition_penalty": 1.03,
        "max_new_tokens": 20,
        "watermark": True,
        "priority": 5,
        "timeout": 10,
    },
}
