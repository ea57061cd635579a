"""Operating LMCache for kvops offload: the server's flags (``server``), supervising it
(``serve``) and summarising its state (``status``). No vLLM or torch imports."""
