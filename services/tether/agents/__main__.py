from tether.agents.main import main

main()
