//! `deltaserve`: the standalone daemon binary, for deployments without Python packaging. The
//! command line itself (flags, tools, the demo model, serving until Ctrl-C or SIGTERM) is
//! `deltaserve_server::cli`, which the Python wheel's `deltaserve` console script runs too.

fn main() {
    std::process::exit(deltaserve_server::cli::run(std::env::args_os(), None));
}
