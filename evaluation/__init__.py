"""ContextRender's evaluation harness, imported as `contextrender_eval`: recorded traces replayed
through the engine (`replay`), the paper's measurements (`evaluate`: Later-Used Result Recall,
the simulated prefix cache, equation 3), the sweep's report and figures (`sweep_report`), and the
`contextrender replay` / `contextrender sweep` commands (`commands`). It uses the engine through
`contextrender` like any other user."""
