"""Hand-picked bad inputs: damaged spec documents, corrupted models, CLI misuse (issue 6).

Each module lists cases as data (an id, how to make the bad input, the exact error class and the key
message content expected); the test modules ``test_bad_specs``, ``test_bad_models`` and
``test_cli_errors`` run them, and ``test_bad_input_count`` checks the total.
"""
