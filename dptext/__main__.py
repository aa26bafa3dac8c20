from dptext.cli.app import main

main()
