"""The serving engine, one idea per module (docs/architecture.md):

geometry    the shapes served (every ladder), made once        no jax
scheduler   queue, rows, admission, chunks, plans → steps       no jax
  step_plans, shape_choice, chunking: its data, its choice of compiled shape, its chunk policy
runner      runs a step plan on the device (params, cache, device lock, the multi-process link)
compiled    the compiled shapes: compile threads, queues, the executable store, first runs
startup     loading, compiling ahead, loading executables ahead, warm-up
engine      the facade: status, submit, tokens, cancel, close; its loop is plan → run → apply
load, steps, towers, link: loading a model, the device steps, the encoder towers, several processes
"""
