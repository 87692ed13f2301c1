@echo off
rem Start a multi-GPU training run on Windows: creates .venv on first use, then asks for the config, the
rem number of GPUs, the backend and the launcher (or takes them as flags), prints the command and runs it.
rem The questions and checks are scripts\start_multi_gpu.py (modules\start_multi_gpu.py), tested on every
rem platform; this file only installs. Windows PyTorch has no NCCL or libuv: the backend is gloo and the
rem rendezvous store runs with USE_LIBUV=0. Run with --help for the options.
setlocal EnableExtensions
cd /d "%~dp0"

if /i "%~1"=="--help" goto help
if /i "%~1"=="-h" goto help

rem PyPI's Windows torch is CPU-only; the CUDA build comes from PyTorch's own index.
if "%TANDEM_TORCH_INDEX%"=="" set "TANDEM_TORCH_INDEX=https://download.pytorch.org/whl/cu126"
if not "%TANDEM_SKIP_INSTALL%"=="1" if not exist ".venv\Scripts\python.exe" (
    echo Creating .venv and installing Tandem ^(first use^)
    py -3 -m venv .venv || python -m venv .venv || (echo start-multi-gpu.bat: could not create .venv; install Python 3.10+ from python.org 1>&2 & exit /b 1)
    ".venv\Scripts\python.exe" -m pip install --upgrade pip || exit /b 1
    ".venv\Scripts\python.exe" -m pip install torch --index-url "%TANDEM_TORCH_INDEX%" || exit /b 1
    ".venv\Scripts\python.exe" -m pip install -e . || exit /b 1
)
if defined TANDEM_PYTHON (set "PY=%TANDEM_PYTHON%") else (set "PY=.venv\Scripts\python.exe")
if not defined TANDEM_PYTHON if not exist "%PY%" (
    echo start-multi-gpu.bat: no .venv\Scripts\python.exe; run without TANDEM_SKIP_INSTALL or set TANDEM_PYTHON 1>&2
    exit /b 2
)
set "USE_LIBUV=0"
"%PY%" scripts\start_multi_gpu.py %*
exit /b %ERRORLEVEL%

:help
rem Only the standard library is needed for the help text: any Python will do, before .venv exists.
if exist ".venv\Scripts\python.exe" (".venv\Scripts\python.exe" scripts\start_multi_gpu.py --help & exit /b 0)
py -3 scripts\start_multi_gpu.py --help || python scripts\start_multi_gpu.py --help
exit /b 0
