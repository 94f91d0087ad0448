"""One training run: its set-up, the loop, the state objects it is made of, callbacks, and the elastic
wrapper."""
