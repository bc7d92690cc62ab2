"""Mixed precision: half-precision compute copies of fp32 master weights, and loss scaling."""
