from tether.runhost.main import main

main()
