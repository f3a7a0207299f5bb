"""What a request says and how its output reads: the tokenizer and chat template, the
request schema, sampling parameters, tool specs and parsers, constraints, stops and the
plan. Pure text and ids: no sockets, no workers (never imports ``router.fleet``)."""
