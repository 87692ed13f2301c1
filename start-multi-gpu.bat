@echo off
rem Start a multi-GPU training run on Windows: creates .venv on first use, asks for the config, the
rem number of GPUs, the backend and the launcher (or takes them as flags), prints the command, runs it.
rem Windows PyTorch has no NCCL, so the backend is gloo. Run with --help for the options.
setlocal EnableExtensions EnableDelayedExpansion
cd /d "%~dp0"

set "ASSUME_YES=0"
set "DRY_RUN=0"
set "CONFIG="
set "NUM_GPUS="
set "BACKEND="
set "LAUNCHER="
set "PORT="
set "DEVICE="
set "OVERRIDES="

:parse
if "%~1"=="" goto parsed
if /i "%~1"=="--help" goto usage
if /i "%~1"=="-h" goto usage
if /i "%~1"=="--yes" (set "ASSUME_YES=1" & shift & goto parse)
if /i "%~1"=="-y" (set "ASSUME_YES=1" & shift & goto parse)
if /i "%~1"=="--dry-run" (set "DRY_RUN=1" & shift & goto parse)
if /i "%~1"=="--spawn" (set "LAUNCHER=spawn" & shift & goto parse)
if "%~2"=="" goto missing_value
if /i "%~1"=="--config" (set "CONFIG=%~2" & shift & shift & goto parse)
if /i "%~1"=="--num-gpus" (set "NUM_GPUS=%~2" & shift & shift & goto parse)
if /i "%~1"=="--backend" (set "BACKEND=%~2" & shift & shift & goto parse)
if /i "%~1"=="--launcher" (set "LAUNCHER=%~2" & shift & shift & goto parse)
if /i "%~1"=="--port" (set "PORT=%~2" & shift & shift & goto parse)
if /i "%~1"=="--device" (set "DEVICE=%~2" & shift & shift & goto parse)
if /i "%~1"=="--config-value" (set OVERRIDES=!OVERRIDES! --config-value "%~2" & shift & shift & goto parse)
echo start-multi-gpu.bat: unknown option "%~1" (see --help) 1>&2
exit /b 2

:missing_value
echo start-multi-gpu.bat: %~1 needs a value (see --help) 1>&2
exit /b 2

:usage
echo Usage: start-multi-gpu.bat [options]
echo.
echo Without options it asks for each setting; press Enter to take the default shown in [brackets].
echo.
echo   --yes, -y              take the defaults for everything not given, ask nothing
echo   --config PATH^|PRESET   config JSON file or preset name (default: #demo), see training_presets\
echo   --num-gpus N           GPUs (or CPU processes with --device cpu) to use (default: all visible)
echo   --backend gloo^|nccl    communication backend (default: gloo; Windows PyTorch has no NCCL)
echo   --spawn                start workers with torch.multiprocessing instead of torchrun
echo   --launcher torchrun^|spawn  the same as a choice (default: torchrun)
echo   --port N               rendezvous port (default: %%MASTER_PORT%%, else a free port)
echo   --device cpu           train in CPU processes over gloo (no GPU needed)
echo   --config-value "K=V"   override one config field (repeatable); quote it: cmd splits at "="
echo   --dry-run              print the command instead of running it
echo.
echo Environment: CUDA_VISIBLE_DEVICES, MASTER_ADDR, MASTER_PORT, NCCL_DEBUG as for PyTorch;
echo   TANDEM_FORCE_SINGLE_GPU=1  train in one process (scripts\train.py)
echo   TANDEM_SKIP_INSTALL=1      do not create or update .venv
echo   TANDEM_PYTHON              the Python to run training with (default: .venv\Scripts\python.exe)
echo   TANDEM_TORCH_INDEX         PyTorch wheel index for the first install
echo                              (default: https://download.pytorch.org/whl/cu126, a CUDA build)
exit /b 0

:parsed
if not "%TANDEM_SKIP_INSTALL%"=="1" if not exist ".venv\Scripts\python.exe" (
    echo Creating .venv and installing Tandem (first use^)
    py -3 -m venv .venv || python -m venv .venv || (echo start-multi-gpu.bat: could not create .venv; install Python 3.10+ from python.org 1>&2 & exit /b 1)
    rem PyPI's Windows torch is CPU-only; the CUDA build comes from PyTorch's own index.
    if "%TANDEM_TORCH_INDEX%"=="" set "TANDEM_TORCH_INDEX=https://download.pytorch.org/whl/cu126"
    ".venv\Scripts\python.exe" -m pip install --upgrade pip || exit /b 1
    ".venv\Scripts\python.exe" -m pip install torch --index-url "!TANDEM_TORCH_INDEX!" || exit /b 1
    ".venv\Scripts\python.exe" -m pip install -e . || exit /b 1
)
if defined TANDEM_PYTHON (set "PY=%TANDEM_PYTHON%") else (set "PY=.venv\Scripts\python.exe")
if not defined TANDEM_PYTHON if not exist "%PY%" (
    echo start-multi-gpu.bat: no .venv\Scripts\python.exe; run without TANDEM_SKIP_INSTALL or set TANDEM_PYTHON 1>&2
    exit /b 2
)
if not "%DEVICE%"=="" if /i not "%DEVICE%"=="cpu" (
    echo start-multi-gpu.bat: --device accepts only cpu, got "%DEVICE%" 1>&2
    exit /b 2
)

if "%CONFIG%"=="" (
    if "%ASSUME_YES%"=="0" (
        echo Presets:
        for %%f in (training_presets\*.json) do echo   %%~nf
    )
    set "CONFIG=#demo"
    if "%ASSUME_YES%"=="0" set /p "CONFIG=Config file or preset name [#demo]: "
)
if not "%CONFIG:~0,1%"=="#" if not exist "%CONFIG%" (
    if exist "training_presets\%CONFIG%.json" (
        set "CONFIG=training_presets\%CONFIG%.json"
    ) else (
        echo start-multi-gpu.bat: config "%CONFIG%" is neither a file nor a preset in training_presets\ 1>&2
        exit /b 2
    )
)

set "GPU_COUNT=0"
if /i not "%DEVICE%"=="cpu" (
    for /f %%i in ('""%PY%" -c "import torch; print(torch.cuda.device_count())" 2^>nul"') do set "GPU_COUNT=%%i"
)
if /i not "%DEVICE%"=="cpu" if "%GPU_COUNT%"=="0" (
    echo No CUDA GPU is visible: training in CPU processes ^(--device cpu^).
    set "DEVICE=cpu"
)
if "%NUM_GPUS%"=="" (
    if /i "%DEVICE%"=="cpu" (set "NUM_GPUS=2") else (set "NUM_GPUS=%GPU_COUNT%")
    if "%ASSUME_YES%"=="0" set /p "NUM_GPUS=Number of GPUs or processes [!NUM_GPUS!]: "
)
set /a "N_CHECK=NUM_GPUS" 2>nul
if not "%N_CHECK%"=="%NUM_GPUS%" goto bad_num
if %N_CHECK% lss 1 goto bad_num
if /i not "%DEVICE%"=="cpu" if %NUM_GPUS% gtr %GPU_COUNT% (
    echo start-multi-gpu.bat: --num-gpus %NUM_GPUS% but only %GPU_COUNT% GPU^(s^) are visible 1>&2
    exit /b 2
)

if "%BACKEND%"=="" (
    set "BACKEND=gloo"
    if "%ASSUME_YES%"=="0" set /p "BACKEND=Backend (gloo/nccl) [gloo]: "
)
if /i not "%BACKEND%"=="gloo" if /i not "%BACKEND%"=="nccl" (
    echo start-multi-gpu.bat: --backend must be gloo or nccl, got "%BACKEND%" 1>&2
    exit /b 2
)
if "%LAUNCHER%"=="" (
    set "LAUNCHER=torchrun"
    if "%ASSUME_YES%"=="0" set /p "LAUNCHER=Launcher (torchrun/spawn) [torchrun]: "
)
if /i not "%LAUNCHER%"=="torchrun" if /i not "%LAUNCHER%"=="spawn" (
    echo start-multi-gpu.bat: --launcher must be torchrun or spawn, got "%LAUNCHER%" 1>&2
    exit /b 2
)
if "%PORT%"=="" set "PORT=%MASTER_PORT%"

for %%v in (CUDA_VISIBLE_DEVICES MASTER_ADDR MASTER_PORT NCCL_DEBUG TANDEM_FORCE_SINGLE_GPU) do (
    if defined %%v (echo %%v=!%%v!) else (echo %%v=^(unset^))
)

if "%TANDEM_FORCE_SINGLE_GPU%"=="1" (
    echo TANDEM_FORCE_SINGLE_GPU=1: training in a single process.
    set CMD="%PY%" scripts\train.py --config-path "%CONFIG%"
    if /i "%DEVICE%"=="cpu" set CMD=!CMD! --config-value general.device=cpu
) else (
    set CMD="%PY%" scripts\train_multi_gpu.py --config-path "%CONFIG%" --num-gpus %NUM_GPUS% --distributed-backend %BACKEND%
    if /i "%LAUNCHER%"=="spawn" set CMD=!CMD! --spawn
    if not "%PORT%"=="" set CMD=!CMD! --port %PORT%
    if /i "%DEVICE%"=="cpu" set CMD=!CMD! --device cpu
)
set CMD=!CMD!%OVERRIDES%

echo Command: !CMD!
if "%DRY_RUN%"=="1" exit /b 0
!CMD!
exit /b %ERRORLEVEL%

:bad_num
echo start-multi-gpu.bat: --num-gpus must be a whole number of 1 or more, got "%NUM_GPUS%" 1>&2
exit /b 2
