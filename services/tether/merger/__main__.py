from tether.merger.main import main

main()
