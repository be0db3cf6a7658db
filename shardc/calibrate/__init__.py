"""``shardc calibrate``: measure the chip jax runs on and write it as a hardware file."""
