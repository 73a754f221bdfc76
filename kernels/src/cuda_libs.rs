//! Which NVRTC a GPU process loads: the newest one this machine's driver can run.
//!
//! cudarc (built for CUDA 12.8 with dynamic loading) opens `libnvrtc.so`, then `libnvrtc.so.12`,
//! `.11`, ... by name, never `.so.13`: on a CUDA 13 machine it finds nothing, and where several
//! toolkits are installed it takes whichever the loader finds first, possibly an NVRTC newer than
//! the driver, whose PTX the driver then refuses. [`prepare`] (feature `cuda`) reads the driver's
//! CUDA version (`cuDriverGetVersion`), finds every NVRTC on the machine (CUDA toolkits, the
//! loader's path, PyPI wheels, `SPECINFER_CUDA_LIB_DIRS`), picks the newest that the driver
//! supports ([`choose`]), links it under the name cudarc opens in a private
//! folder, and re-executes the process with that folder first on `LD_LIBRARY_PATH` (the loader
//! reads it only when a process starts). The kernels are compiled to CUBIN for the device's exact
//! architecture as well (`cuda::compile_cubin`), which a driver loads whatever minor version of
//! NVRTC of its own major made it.
//!
//! The choice is plain logic over what was found, tested without a GPU; only [`prepare`] touches
//! the machine.

use std::path::{Path, PathBuf};

/// A CUDA version, as `cuDriverGetVersion` gives it (12080 is 12.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CudaVersion {
    pub major: u32,
    pub minor: u32,
}

impl CudaVersion {
    pub fn from_driver(v: i32) -> Self {
        CudaVersion {
            major: (v / 1000).max(0) as u32,
            minor: ((v % 1000) / 10).max(0) as u32,
        }
    }
}

impl std::fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A library found on the machine and the CUDA version its file name says it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    pub version: CudaVersion,
}

/// The CUDA version a file named like `libNAME.so.12.8.93` (or `.so.13`, a link to a fuller
/// name, see [`found_in`]) belongs to; `None` for other files (`libnvrtc-builtins...`, `.alt`).
pub fn version_in_name(lib: &str, file_name: &str) -> Option<CudaVersion> {
    let rest = file_name.strip_prefix(&format!("lib{lib}.so."))?;
    let mut parts = rest.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = match parts.next() {
        None => 0,
        Some(m) => m.parse().ok()?,
    };
    if parts.any(|p| p.parse::<u32>().is_err()) {
        return None;
    }
    Some(CudaVersion { major, minor })
}

/// The copies of `lib` in `dir`, each versioned by its own name or, for a link such as
/// `libnvrtc.so.13`, by its target's fuller name when that says more.
pub fn found_in(lib: &str, dir: &Path) -> Vec<Found> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(mut version) = version_in_name(lib, &name.to_string_lossy()) else {
            continue;
        };
        let path = entry.path();
        if let Some(target) = std::fs::canonicalize(&path)
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
            .and_then(|n| version_in_name(lib, &n))
        {
            if target.major == version.major {
                version = version.max(target);
            }
        }
        found.push(Found { path, version });
    }
    found
}

/// The library to load for a driver of version `driver`: the newest found whose version the
/// driver supports (no newer than it); else the newest of the driver's major version (CUDA's
/// minor-version compatibility: code compiled to CUBIN runs, only PTX would be refused); never
/// one of a newer major.
pub fn choose(driver: CudaVersion, found: &[Found]) -> Option<&Found> {
    found
        .iter()
        .filter(|f| f.version <= driver)
        .max_by_key(|f| f.version)
        .or_else(|| {
            found
                .iter()
                .filter(|f| f.version.major == driver.major)
                .min_by_key(|f| f.version)
        })
}

/// Folders where CUDA's libraries live on Linux machines: `extra` (an operator's own), the
/// loader's path, CUDA toolkits, the distribution's library folders, and PyPI wheels
/// (`nvidia/*/lib` in site-packages, the layout of `nvidia-cuda-nvrtc-cu12` and the CUDA 13
/// wheels).
pub fn search_dirs(extra: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = extra.to_vec();
    if let Some(p) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&p));
    }
    let children = |dir: &Path, prefix: &str| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
            .map(|e| e.path())
            .collect();
        v.sort();
        v
    };
    for toolkit in children(Path::new("/usr/local"), "cuda") {
        dirs.push(toolkit.join("lib64"));
        dirs.push(toolkit.join("lib"));
        dirs.push(toolkit.join("targets/x86_64-linux/lib"));
    }
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/opt/cuda/lib64",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut python_roots = vec![
        PathBuf::from("/usr/local/lib"),
        PathBuf::from("/usr/lib"),
        PathBuf::from("/opt/conda/lib"),
    ];
    if let Some(home) = std::env::var_os("HOME") {
        python_roots.push(Path::new(&home).join(".local/lib"));
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        python_roots.push(Path::new(&venv).join("lib"));
    }
    for root in python_roots {
        for python in children(&root, "python3") {
            for packages in ["site-packages", "dist-packages"] {
                for wheel in children(&python.join(packages).join("nvidia"), "") {
                    dirs.push(wheel.join("lib"));
                }
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| d.is_dir() && seen.insert(std::fs::canonicalize(d).unwrap_or(d.clone())));
    dirs
}

/// The libraries [`prepare`] chose, for the log.
#[derive(Clone, Debug)]
pub struct Chosen {
    pub driver: CudaVersion,
    pub nvrtc: Found,
}

impl std::fmt::Display for Chosen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "driver supports CUDA {}; NVRTC {} ({})",
            self.driver,
            self.nvrtc.version,
            self.nvrtc.path.display()
        )
    }
}

/// The file a library whose name starts with `prefix` (such as `libnvrtc`) was loaded from in
/// this process, from `/proc/self/maps`: what was really loaded, whatever the loader searched.
pub fn loaded_library(prefix: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{prefix}.so")))
        })
        .map(PathBuf::from)
}

/// Reads the driver's CUDA version from `libcuda.so.1`, without cudarc (which panics when the
/// driver is missing).
#[cfg(feature = "cuda")]
pub fn driver_version() -> Result<CudaVersion, String> {
    // SAFETY: libcuda's documented entry point, called with a valid out pointer; the library
    // stays loaded for the process (cudarc opens it again by the same name).
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").map_err(|e| {
            format!("no NVIDIA driver (libcuda.so.1 cannot be loaded: {e}): use --device cpu")
        })?;
        let get: libloading::Symbol<unsafe extern "C" fn(*mut i32) -> i32> = lib
            .get(b"cuDriverGetVersion\0")
            .map_err(|e| format!("libcuda.so.1 has no cuDriverGetVersion: {e}"))?;
        let mut v = 0i32;
        let status = get(&mut v);
        std::mem::forget(lib);
        if status != 0 {
            return Err(format!(
                "cuDriverGetVersion failed with CUDA error {status}"
            ));
        }
        Ok(CudaVersion::from_driver(v))
    }
}

/// Makes this process load the NVRTC the driver supports (see the module doc): when the
/// loader's path does not start with the folder of the link to it, sets it and re-executes
/// the program with the same arguments (so it does not return); otherwise returns what was
/// chosen. Call it before anything touches CUDA.
#[cfg(feature = "cuda")]
pub fn prepare() -> Result<Chosen, String> {
    let driver = driver_version()?;
    let extra: Vec<PathBuf> = std::env::var_os("SPECINFER_CUDA_LIB_DIRS")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let dirs = search_dirs(&extra);
    let pick = |lib: &str, wheel: &str| -> Result<Found, String> {
        let found: Vec<Found> = dirs.iter().flat_map(|d| found_in(lib, d)).collect();
        choose(driver, &found).cloned().ok_or_else(|| {
            let seen: Vec<String> = found
                .iter()
                .map(|f| format!("{} ({})", f.path.display(), f.version))
                .collect();
            format!(
                "no lib{lib} that a driver for CUDA {driver} can run: found [{}]; install the \
                 CUDA {major} toolkit's, or the PyPI wheel {wheel}-cu{major}, or name its folder in \
                 SPECINFER_CUDA_LIB_DIRS",
                seen.join(", "),
                major = driver.major
            )
        })
    };
    let chosen = Chosen {
        driver,
        nvrtc: pick("nvrtc", "nvidia-cuda-nvrtc")?,
    };
    // A folder of this user's own (a shared /tmp would let another user plant libraries),
    // named by what it links to, so every process with the same choice shares it.
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/specinfer")))
        .ok_or("neither XDG_RUNTIME_DIR nor HOME is set: nowhere to link the CUDA libraries")?;
    let hash = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        chosen.nvrtc.path.hash(&mut h);
        h.finish()
    };
    let links = base.join(format!("cuda-libs-{}-{hash:016x}", chosen.driver));
    let already = std::env::var_os("LD_LIBRARY_PATH")
        .and_then(|p| std::env::split_paths(&p).next())
        .is_some_and(|first| first == links);
    if already {
        return Ok(chosen);
    }
    std::fs::create_dir_all(&links).map_err(|e| format!("{}: {e}", links.display()))?;
    let link = links.join("libnvrtc.so");
    if std::fs::read_link(&link).ok().as_deref() != Some(chosen.nvrtc.path.as_path()) {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&chosen.nvrtc.path, &link)
            .map_err(|e| format!("linking {}: {e}", link.display()))?;
    }
    // The chosen library's own folder follows, for what it opens beside it (its builtins).
    let mut path = vec![links.clone()];
    path.extend(chosen.nvrtc.path.parent().map(Path::to_path_buf));
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.extend(std::env::split_paths(&old));
    }
    let path = std::env::join_paths(path).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    use std::os::unix::process::CommandExt;
    let err = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", path)
        .exec();
    Err(format!(
        "re-executing with the chosen CUDA libraries: {err}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(major: u32, minor: u32) -> CudaVersion {
        CudaVersion { major, minor }
    }

    fn found(path: &str, version: CudaVersion) -> Found {
        Found {
            path: path.into(),
            version,
        }
    }

    #[test]
    fn versions_come_from_the_driver_and_from_file_names() {
        assert_eq!(CudaVersion::from_driver(12080), v(12, 8));
        assert_eq!(CudaVersion::from_driver(13000), v(13, 0));
        assert_eq!(
            version_in_name("nvrtc", "libnvrtc.so.12.8.93"),
            Some(v(12, 8))
        );
        assert_eq!(version_in_name("nvrtc", "libnvrtc.so.13"), Some(v(13, 0)));
        assert_eq!(
            version_in_name("cublas", "libcublas.so.12.9.1.4"),
            Some(v(12, 9))
        );
        assert_eq!(version_in_name("nvrtc", "libnvrtc.so"), None);
        assert_eq!(version_in_name("nvrtc", "libnvrtc-builtins.so.12.8"), None);
        assert_eq!(version_in_name("nvrtc", "libnvrtc.so.12.alt"), None);
        assert_eq!(version_in_name("cublas", "libcublasLt.so.12"), None);
    }

    #[test]
    fn the_newest_library_the_driver_supports_is_chosen_never_a_newer_major() {
        let all = [
            found("/usr/local/cuda-12.4/lib64/libnvrtc.so.12.4.99", v(12, 4)),
            found("/usr/local/cuda-12.8/lib64/libnvrtc.so.12.8.93", v(12, 8)),
            found("/usr/local/cuda-13.0/lib64/libnvrtc.so.13.0.48", v(13, 0)),
            found("/site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", v(12, 0)),
        ];
        // A 12.8 driver: 12.8, not 13.0 (sort -V over paths picked 13.0).
        assert_eq!(choose(v(12, 8), &all).unwrap().version, v(12, 8));
        // A 12.6 driver: 12.4 beats the newer-than-driver 12.8.
        assert_eq!(choose(v(12, 6), &all).unwrap().version, v(12, 4));
        // A 13.0 driver: 13.0, the .so.13 that cudarc never opens by itself.
        assert_eq!(choose(v(13, 0), &all).unwrap().version, v(13, 0));
        // A 13.2 driver takes 13.0 (older minor of its major is supported).
        assert_eq!(choose(v(13, 2), &all).unwrap().version, v(13, 0));
        // Only newer minors of the driver's major: the oldest of them (CUBIN still loads).
        let newer = [
            found("/a/libnvrtc.so.12.9.1", v(12, 9)),
            found("/b/libnvrtc.so.12.8.2", v(12, 8)),
        ];
        assert_eq!(choose(v(12, 2), &newer).unwrap().version, v(12, 8));
        // Only a newer major: nothing (its PTX and CUBIN need a newer driver).
        assert!(choose(v(12, 8), &all[2..3]).is_none());
        assert!(choose(v(12, 8), &[]).is_none());
    }

    #[test]
    fn libraries_are_found_by_their_names_and_their_links_targets() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        std::fs::write(dir.join("libnvrtc.so.13.0.48"), b"").unwrap();
        std::os::unix::fs::symlink("libnvrtc.so.13.0.48", dir.join("libnvrtc.so.13")).unwrap();
        std::fs::write(dir.join("libnvrtc-builtins.so.13.0"), b"").unwrap();
        std::fs::write(dir.join("libcublas.so.12"), b"").unwrap();
        let mut nvrtc = found_in("nvrtc", &dir);
        nvrtc.sort_by(|a, b| a.path.cmp(&b.path));
        assert_eq!(nvrtc.len(), 2);
        assert!(nvrtc.iter().all(|f| f.version == v(13, 0)), "{nvrtc:?}");
        let cublas = found_in("cublas", &dir);
        assert_eq!(
            cublas,
            vec![found(
                dir.join("libcublas.so.12").to_str().unwrap(),
                v(12, 0)
            )]
        );
        assert!(search_dirs(std::slice::from_ref(&dir)).contains(&dir));
        // The C library this test links is in the process's map; nothing named so is not.
        assert!(loaded_library("libc").is_some());
        assert!(loaded_library("libspecinfer-none").is_none());
    }
}
