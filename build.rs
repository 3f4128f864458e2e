// `sqlx::migrate!` embeds migrations/ at compile time but does not tell Cargo to watch the
// directory, so a new migration file would not rebuild the crate without this.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
