from tether.gateway.main import main

main()
