"""Pipeline parallelism: stages of layers over a ``pipeline`` mesh axis, schedules, bubbles.

``stages`` checks a pipelined spec and splits its layers; ``boundary`` says what a stage sends
the next and which dim microbatches cut; ``schedules`` simulates every
schedule (the same simulation draws ``gantt``'s picture, and ``ticks`` places its orders in the
lowered program's tick table); ``bubbles`` has the closed forms.
None of it imports jax or sympy.
"""
