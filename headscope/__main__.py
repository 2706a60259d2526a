from headscope.cli import main

main()
