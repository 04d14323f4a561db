"""A pipeline's lowered programs: the chunks a stage runs, the slot program of its gradients and of its
evaluation, residuals kept between slots, the zero-bubble backward split, the links between stages, and
what each piece costs."""
