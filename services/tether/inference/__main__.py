from tether.inference.main import main

main()
