from rlhfkit.cli.main import main

main()
