"""What ContextRender adds to `jac start` (jac-scale's server), one job per module: `plugin` (the
server class registered by contextrender.jac), `app` (that class: errors, limits, routes, the admin
account), `guard` (the request guard middleware), `errors` (walker errors as HTTP statuses),
`secret_checks`, `access_table` (access levels from the compile cache), `distributed` (several
processes on one store) and `serve` (the `contextrender serve` command)."""
