"""copy.ptx: a grid-stride float4 copy, the device bandwidth `bench gpu` reports."""

PARAMS = {}
