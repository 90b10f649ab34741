"""Embedded tasks (the defaults of the demo and the tests), and the short names every role accepts."""

# Short name -> `module:function`.  Kept free of torch imports: config checks read it.
BUILT_IN = {
    "digits": "elasticfed.common.tasks.digits:task",
    "stdlib-lm": "elasticfed.common.tasks.stdlib_lm:task",
    "stdlib-lm-base": "elasticfed.common.tasks.stdlib_lm:base_task",
}
