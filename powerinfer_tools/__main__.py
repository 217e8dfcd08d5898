from powerinfer_tools.cli import main

main()
