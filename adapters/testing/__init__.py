"""What tests and benchmarks use, shipped so that users can test their agents too: a scripted fake
upstream (`fake_upstream`, with what it refuses as the real services do: `fake_checks`), an ASGI
app on a loopback port (`loopback`), and the pairing check of a rendered list (`checks`)."""
