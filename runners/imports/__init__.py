"""`vigil import`: another supervisor's configuration read by a parser made for its format
(supervisord, Procfile, PM2, process-compose), translated into the hosts file `vigil apply`
reads (runners/cli/hostfile.py). One module a format, each returning an Imported; programs.py
holds what they share (commands to build and args, host names, the unmapped lines);
tomlwrite.py writes the file. Imports only the standard library, PyYAML and models."""
